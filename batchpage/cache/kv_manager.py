"""KVCacheManager: lends KV blocks to sequences. The only writer of `Sequence.block_table`.

Contracts:
- A sequence holds one pool reference per entry of its block table (see block_pool.py).
- `allocate` either covers the sequence's next tokens completely or raises and changes nothing;
  ask `can_allocate` first.
- Before a sequence writes into a block that is shared, it gets a private copy: `allocate` returns
  the copies (src -> dst) that the model runner must apply before the step's forward.
- `free` releases every reference the sequence holds and leaves its block table empty.
"""

from __future__ import annotations

from typing import NamedTuple

from batchpage.cache.block_pool import BlockPool, OutOfBlocks
from batchpage.engine.sequence import Sequence


class BlockCopy(NamedTuple):
    src: int
    dst: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def _needs_cow(self, seq: Sequence) -> bool:
        # The next token lands in the last block when it is partly filled; it must be private.
        table = seq.block_table
        return (
            bool(table)
            and seq.num_computed_tokens % self.block_size != 0
            and self.pool.refcount(table[-1]) > 1
        )

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(seq.block_table)) + int(self._needs_cow(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Make room for seq's next num_new_tokens tokens; returns the block copies to apply."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.pool.num_free:
            raise OutOfBlocks(
                f"sequence {seq.seq_id} needs {need} blocks, {self.pool.num_free} free"
            )
        copies = []
        if self._needs_cow(seq):
            res = self.pool.cow(seq.block_table[-1])
            assert res.copy_from is not None
            copies.append(BlockCopy(src=res.copy_from, dst=res.block))
            seq.block_table[-1] = res.block
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        seq.block_table.extend(self.pool.allocate(total - len(seq.block_table)))
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (parallel samples, beams); both must cow to write."""
        assert not child.block_table, "the child must hold no blocks yet"
        self.pool.share(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []

    def check_integrity(self, live: list[Sequence]) -> None:
        """The pool is consistent and holds exactly the references the live sequences own."""
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for seq in live:
            assert len(seq.block_table) >= blocks_for(seq.num_computed_tokens, self.block_size)
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == held.get(b, 0), f"block {b}: reference leak"
