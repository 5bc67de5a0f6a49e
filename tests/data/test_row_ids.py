"""IdTally against a brute-force reading of the same ids (a dict of every id, as the tally once
kept), with hashes that collide forced, and what it holds per id."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from batchpage.data import row_ids
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
        key = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
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


# Ids that are equal only as text, ids that differ in a byte, and ids that no strict UTF-8
# encoder takes (a lone surrogate from a JSON "\ud800", bytes that are not UTF-8).
AWKWARD = ["7", 7, "\ud800", "\ud801", b"\xff", b"\xfe", "\ufffd", "é", "e\u0301", "", " "]


@pytest.mark.parametrize("hashing", ["python", "all collide", "by length"])
@pytest.mark.parametrize("seed", range(25))
def test_ids_whose_hashes_collide_are_compared_by_their_text(
    seed: int, hashing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash says only where to look: with every hash equal (or equal by length) the tally
    still finds exactly the duplicates the brute-force reading finds."""
    if hashing == "all collide":
        monkeypatch.setattr(row_ids, "hash", lambda key: 0, raising=False)
    elif hashing == "by length":
        monkeypatch.setattr(row_ids, "hash", len, raising=False)
    rng = random.Random(seed)
    pool = [f"id-{i}" for i in range(rng.randint(1, 40))] + AWKWARD + [None]
    values = [rng.choice(pool) for _ in range(rng.randint(0, 80))]
    limit = rng.choice([None, rng.randint(0, len(values) + 1)])
    tally = IdTally(limit)
    for i, v in enumerate(values):
        tally.add(i, v)
        tally.check_integrity()
    dups, nulls = brute(values, limit)
    assert tally.duplicates == dups[:5] and tally.nulls == nulls[:5]
    assert tally.null_count == len(nulls)


def test_a_row_told_twice_is_not_its_own_duplicate() -> None:
    tally = IdTally()
    for i, v in [(0, "a"), (0, "a"), (1, "b"), (2, "a")]:
        tally.add(i, v)
    assert tally.duplicates == ["'a' (rows 0 and 2)"]


def test_the_tally_holds_an_id_in_a_few_words() -> None:
    """Every id is held until the check: its bytes and three 8-byte words, not a str object
    and an int in a dict."""
    ids = [f"row-{i:07d}" for i in range(100_000)]  # made before the count starts
    tracemalloc.start()
    try:
        tally = IdTally()
        for i, key in enumerate(ids):
            tally.add(i, key)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        tally.check("ids", "fix")
        _, checking = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_id = 3 * 8 + len(ids[0])
    assert held < 1.3 * per_id * len(ids)  # arrays grow ahead of what they hold
    assert checking < held + 3 * 8 * len(ids)  # the sort: an order and the sorted hashes
