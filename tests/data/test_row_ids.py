"""IdTally against a brute-force reading of the same ids."""

from __future__ import annotations

import random

import pytest

from batchpage.data.readers import DatasetError
from batchpage.data.row_ids import IdTally


def brute(values: list, limit: int | None) -> tuple[list[str], list[int]]:
    """Every duplicate (with the row of its first copy) and every null row, in row order."""
    first: dict[str, int] = {}
    dups, nulls = [], []
    for i, v in enumerate(values[:limit]):
        if v is None:
            nulls.append(i)
            continue
        key = str(v)
        if key in first:
            dups.append(f"{key!r} (rows {first[key]} and {i})")
        first.setdefault(key, i)
    return dups, nulls


@pytest.mark.parametrize("seed", range(40))
def test_the_tally_finds_what_a_brute_force_reading_finds(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    pool = [f"r{i}" for i in range(rng.randint(1, 80))] + [7, 7.5, None]
    values = [rng.choice(pool) for _ in range(n)]
    limit = rng.choice([None, rng.randint(0, n + 1)])
    tally = IdTally(limit)
    for i, v in enumerate(values):
        tally.add(i, v)
    dups, nulls = brute(values, limit)
    assert tally.duplicates == dups[:5] and tally.nulls == nulls[:5]
    assert tally.null_count == len(nulls)
    if dups:
        with pytest.raises(DatasetError, match="duplicate ids: " + dups[0].split(" ")[0]):
            tally.check("ids", "fix")
    elif nulls:
        with pytest.raises(DatasetError, match=f"null at rows {nulls[0]}"):
            tally.check("ids", "fix")
        tally.check("ids", "fix", nulls_allowed=True)
    else:
        tally.check("ids", "fix")
