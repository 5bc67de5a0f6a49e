"""BlockPool: the allocator of KV block ids, with reference counts.

Ownership contract:
- A block id is either free (reference count 0, on the free list) or held (count >= 1, not on
  the free list). Nothing else.
- Every holder owns exactly one reference: each sequence whose block table lists the block, and
  the radix tree node that caches it. A holder that lets go calls `release` once per block.
- A block with count > 1 is shared and read-only: a holder that must write into it first takes a
  private copy (`BlockPool.cow`), the copy of the data itself being the caller's job.
- A block goes back to the free list the moment its last holder releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple


class OutOfBlocks(RuntimeError):
    """Raised by `allocate` when the request exceeds the free blocks. Ask `num_free` first."""


class CowResult(NamedTuple):
    block: int  # the block the writer now holds privately
    copy_from: int | None  # the shared block whose data must be copied into `block`, if any


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # FIFO reuse spreads writes over the pool; any order is correct.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks; the caller holds one reference to each."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """A new holder takes a reference to blocks that are already held (fork, cache hit)."""
        for b in blocks:
            if self._refcount[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refcount[b] += 1

    def release(self, blocks: Iterable[int]) -> list[int]:
        """A holder lets go of one reference per block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if self._refcount[b] < 1:
                raise ValueError(f"block {b} released more often than it was held")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def cow(self, block: int) -> CowResult:
        """Make `block` writable for one holder.

        A private block (count 1) is returned as is. A shared one costs a fresh block: the holder's
        reference moves to it and the caller copies the data from `copy_from`.
        """
        if self._refcount[block] < 1:
            raise ValueError(f"block {block} is free; nothing to write into")
        if self._refcount[block] == 1:
            return CowResult(block=block, copy_from=None)
        (fresh,) = self.allocate(1)
        self._refcount[block] -= 1
        return CowResult(block=fresh, copy_from=block)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, count in enumerate(self._refcount):
            assert count >= 0, f"block {b} has a negative reference count"
            on_free = b in free
            assert (count == 0) == on_free, f"block {b}: count {count}, on free list {on_free}"
