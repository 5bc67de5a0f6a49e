"""RowSet (the writer's done rows, a bitmap) against a Python set of the same indices, and what
it costs per row."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from batchpage.output.row_set import RowSet


@pytest.mark.parametrize("seed", range(30))
def test_a_row_set_answers_as_a_set_of_ints_does(seed: int) -> None:
    rng = random.Random(seed)
    top = rng.choice([8, 64, 1000, 100_000])
    rows, reference = RowSet(), set()
    for _ in range(rng.randint(1, 60)):
        if rng.random() < 0.6:
            index = rng.randrange(top)
            assert rows.add(index) == (index not in reference)
            reference.add(index)
        else:  # a shard's index column: repeats and indices already in allowed
            found = [rng.randrange(top) for _ in range(rng.randint(0, 50))]
            kinds = [np.int64, np.int32, *([np.uint16] if top <= 2**16 else [])]
            rows.update(np.array(found, dtype=rng.choice(kinds)))
            reference.update(found)
        rows.check_integrity()
        assert len(rows) == len(reference)
        probes = [rng.randrange(top + 64) for _ in range(20)] + [-1, 10**12]
        assert [p in rows for p in probes] == [p in reference for p in probes]
        assert all(np.int64(p) in rows for p in reference)
    assert list(rows) == sorted(reference)
    assert RowSet(sorted(reference, reverse=True)).__len__() == len(reference)


def test_a_row_set_refuses_negative_indices_and_takes_nothing() -> None:
    rows = RowSet()
    with pytest.raises(ValueError, match=">= 0"):
        rows.add(-1)
    with pytest.raises(ValueError, match=">= 0"):
        rows.update(np.array([3, -2]))
    rows.update(np.array([], dtype=np.int64))
    rows.check_integrity()
    assert len(rows) == 0 and list(rows) == [] and 0 not in rows and "0" not in rows


def test_a_row_set_holds_a_bit_a_row() -> None:
    """Done rows added one by one, as a job adds them: about rows / 8 bytes."""
    tracemalloc.start()
    try:
        rows = RowSet()
        for index in range(200_000):
            rows.add(index)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rows) == 200_000 and 199_999 in rows and 200_000 not in rows
    assert held < 200_000 // 8 * 2 + 4096  # the bitmap grows by doubling
