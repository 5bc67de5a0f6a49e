"""The prefix-order windows and the work queue, against brute force: windows are contiguous,
cover every row once and cut where neighbours share least; every row is delivered exactly once
whatever replicas die and when."""

from __future__ import annotations

import random

import pytest

from batchpage.executor.windows import common_prefix, cut_windows, prefix_order
from batchpage.executor.work_queue import WorkQueue, least_loaded


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Groups sharing prefixes of random lengths, as a shared system prompt would."""
    heads = [[rng.randrange(5) for _ in range(rng.randrange(0, 6))] for _ in range(4)]
    return [
        rng.choice(heads) + [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        for _ in range(count)
    ]


@pytest.mark.parametrize("seed", range(20))
def test_windows_cover_the_prefix_order_contiguously_and_cut_at_the_least_shared(seed) -> None:
    rng = random.Random(seed)
    prompts = random_prompts(rng, rng.randrange(1, 60))
    order = prefix_order(prompts, "prefix")
    assert [prompts[i] for i in order] == sorted(prompts)  # the engine's own order
    assert prefix_order(prompts, "fcfs") == list(range(len(prompts)))
    keys = [prompts[i] for i in order]
    size = rng.randrange(1, 9)
    ranges = cut_windows(keys, size)
    assert [i for r in ranges for i in r] == list(range(len(keys)))
    lo, hi = max(1, size - size // 2), size + size // 2
    for k, r in enumerate(ranges):
        last = k == len(ranges) - 1
        assert len(r) <= hi and (last or len(r) >= lo)
        if last:
            continue
        # Brute force: no cut in the allowed span separates neighbours sharing less.
        span = range(r.start + lo, r.start + hi + 1)
        best = min(common_prefix(keys[e - 1], keys[e]) for e in span)
        assert common_prefix(keys[r.stop - 1], keys[r.stop]) == best


def test_a_group_that_fits_a_window_is_not_split() -> None:
    keys = [[1, 2, 3, i] for i in range(3)] + [[7, 8, i] for i in range(5)]
    assert cut_windows(keys, 4) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="window size"):
        cut_windows(keys, 0)


@pytest.mark.parametrize("seed", range(30))
def test_every_row_is_delivered_once_whatever_dies(seed) -> None:
    """Replicas take windows, deliver some of their rows (some twice), finish or die at random;
    the model is the set of rows delivered, which must end as every row exactly once."""
    rng = random.Random(seed)
    total = rng.randrange(1, 40)
    rows = list(range(total))
    rng.shuffle(rows)
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randrange(0, 6))))
    windows = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    queue = WorkQueue(windows)
    delivered: list[int] = []
    running = []
    while not queue.finished:
        queue.check_integrity()
        if queue.pending and (not running or rng.random() < 0.4):
            running.append(queue.take())
            continue
        window = running.pop(rng.randrange(len(running)))
        dies = rng.random() < 0.3
        count = rng.randrange(len(window.positions)) if dies else len(window.positions)
        for position in rng.sample(window.positions, count) + rng.sample(window.positions, 1):
            if queue.deliver(window.id, position):
                delivered.append(position)
        left = queue.release(window.id)
        assert left == len([p for p in window.positions if p not in delivered])
    queue.check_integrity()
    assert sorted(delivered) == list(range(total)) and queue.delivered == total
    assert queue.take() is None


def test_a_row_outside_the_window_is_refused() -> None:
    queue = WorkQueue([[0, 1], [2]])
    window = queue.take()
    with pytest.raises(ValueError, match="not part of running window"):
        queue.deliver(window.id, 2)
    assert queue.release(window.id) == 2  # nothing delivered: both go back, at the front
    retry = queue.take()
    assert retry.positions == (0, 1) and retry.retry


@pytest.mark.parametrize("seed", range(10))
def test_windows_go_to_the_least_loaded_live_replica(seed) -> None:
    """Handing windows out one by one with least_loaded, against the loads written out by
    hand: every live replica gets one before any gets a second, none gets more than `most`,
    and a lost replica gets none."""
    rng = random.Random(seed)
    replicas, most = rng.randrange(1, 6), rng.randrange(1, 4)
    live = [rng.random() < 0.8 for _ in range(replicas)]
    load = [rng.randrange(most + 1) if live[i] else rng.randrange(3) for i in range(replicas)]
    start = list(load)
    chosen_at = []  # the load of each replica when it was chosen
    while (replica := least_loaded(load, live, most)) is not None:
        assert live[replica] and load[replica] < most
        assert load[replica] == min(n for n, up in zip(load, live, strict=True) if up)
        chosen_at.append(load[replica])
        load[replica] += 1
    assert chosen_at == sorted(chosen_at)  # no replica gets a k-th before all have k - 1
    for i in range(replicas):  # full up to `most`, the lost untouched
        assert load[i] == (most if live[i] else start[i])
