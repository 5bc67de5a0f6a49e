"""Cutting a window of the job into contiguous ranges of its prefix order, one per replica task.

The job's prefix order is the engine's own (`schedule=prefix` queues a batch sorted by token
ids, so prompts that share a prefix are neighbours). Handing replicas contiguous ranges of that
order keeps each shared-prefix group on one replica, where its KV is computed once and then
borrowed from the radix cache; round-robin single rows would compute it on every replica.

A cut is placed where neighbours share the fewest tokens, within half a window of the nominal
size, so a group that fits in a window is not split just because it straddles a multiple of the
size.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_order(prompts: Sequence[Sequence[int]], schedule: str) -> list[int]:
    """Positions of `prompts` in the order the engine would queue them."""
    positions = list(range(len(prompts)))
    if schedule == "prefix":
        positions.sort(key=lambda i: list(prompts[i]))
    return positions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def cut_windows(keys: Sequence[Sequence[int]], size: int) -> list[range]:
    """Contiguous ranges covering keys (already in prefix order), each of about `size` rows:
    between size/2 and 3*size/2, except a shorter last one. The cut lands on the smallest
    common prefix between neighbours in that span; ties go to the cut nearest `size`."""
    if size < 1:
        raise ValueError(f"window size must be >= 1, got {size}")
    ranges: list[range] = []
    start, n = 0, len(keys)
    lo_off, hi_off = max(1, size - size // 2), size + size // 2
    while start < n:
        if n - start <= hi_off:
            ranges.append(range(start, n))
            break
        # A cut at `end` separates keys[end - 1] and keys[end].
        candidates = range(start + lo_off, start + hi_off + 1)
        end = min(
            candidates,
            key=lambda e: (common_prefix(keys[e - 1], keys[e]), abs(e - start - size)),
        )
        ranges.append(range(start, end))
        start = end
    return ranges
