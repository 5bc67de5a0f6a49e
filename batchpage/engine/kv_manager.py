"""KVCacheManager: lends KV blocks to sequences. The only writer of `Sequence.block_table`.

It owns the BlockPool and, with prefix caching on, the RadixCache over it.

Contracts:
- A sequence holds one pool reference per entry of its block table (see block_pool.py); the
  tree holds one per block it caches (see radix_cache.py).
- `lend_prefix` gives a sequence that holds nothing the longest cached prefix of its tokens (at
  least one token is left to compute) and locks the tree path it uses until `free`.
- `allocate` either covers the sequence's next tokens completely or raises OutOfBlocks and
  changes nothing (`can_allocate` asks without trying). It evicts unlocked cached blocks when
  the free list is short.
- Before a sequence writes into a block that is shared, it gets a private copy: `allocate` returns
  the copies (src -> dst) that the model runner must apply before the step's forward.
- `free` caches the sequence's computed full blocks (when asked), releases every reference it
  holds and leaves its block table empty.
- K/V computed under a LoRA adapter is only ever served to rows of that adapter: the tree's key
  of an adapter's token t is t + (lora_int_id << 32) (`tree_key`), so keys of different
  adapters (and the base model's, 0) never match, while one adapter's rows share as usual.
- K/V over an image's placeholder positions is served only to prompts with the same picture
  there: those positions' key is the image's content key (PromptImage.key), not the token.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from batchpage.cache.block_pool import BlockPool, OutOfBlocks
from batchpage.cache.radix_cache import EvictionPolicy, RadixCache, RadixNode
from batchpage.engine.sequence import Sequence


class BlockCopy(NamedTuple):
    src: int
    dst: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def tree_key(seq: Sequence, n: int) -> list[int]:
    """The prefix cache's key of seq's first n tokens: the tokens, an image's positions holding
    its content key in place of their placeholder token (equal placeholders over different
    pictures never share K/V), all offset by the adapter's id for a LoRA request (vocabularies
    are far below 2**32, image keys above 2**62)."""
    tokens = seq.token_ids[:n]
    request = seq.request
    if request.images:
        key = np.asarray(tokens, dtype=object)
        for image in request.images:
            at = np.asarray(image.positions, dtype=np.int64)
            key[at[at < n]] = image.key
        tokens = key.tolist()
    lora = request.lora
    if lora is None:
        return tokens
    offset = lora.lora_int_id << 32
    return [t + offset for t in tokens]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        eviction_policy: EvictionPolicy = "lru",
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.tree = RadixCache(self.pool, block_size, eviction_policy) if prefix_caching else None
        self._locked: dict[int, RadixNode] = {}  # seq_id -> the tree node its prefix is locked at
        # Live sequences whose block tables changed since take_changed (the input batch's rows).
        self._changed: dict[int, Sequence] = {}
        # Forked sequences that have not written since: their partly filled last block may be
        # shared, so their next allocate may copy it (see shared_tails).
        self._forked: dict[int, Sequence] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: free ones plus cached ones nobody uses."""
        return self.pool.num_free + (self.tree.evictable_blocks if self.tree else 0)

    def lend_prefix(self, seq: Sequence) -> int:
        """Share the longest cached block-aligned prefix with a sequence that holds no blocks;
        returns the number of tokens it no longer needs to compute."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.tree is None or seq.reads_every_prompt_row:
            return 0  # prompt logprobs (MEAN pooling) need the output of every prompt position
        m = self.tree.match_prefix(tree_key(seq, seq.num_tokens - 1))
        node = m.node
        if m.num_tokens:
            # A match may end inside a node; re-inserting the matched prefix (it adopts nothing)
            # splits it there, so the lock pins exactly the blocks this sequence uses.
            node = self.tree.insert(tree_key(seq, m.num_tokens), m.blocks).node
        self.tree.lock(node)
        self._locked[seq.seq_id] = node
        self.pool.share(m.blocks)
        seq.block_table = list(m.blocks)
        seq.num_computed_tokens = m.num_tokens
        self._changed[seq.seq_id] = seq
        return m.num_tokens

    def _needs_cow(self, table: list[int], computed: int) -> bool:
        # The next token lands in the last block when it is partly filled; it must be private.
        return bool(table) and computed % self.block_size != 0 and self.pool.refcount(table[-1]) > 1

    def _target_blocks(self, computed: int, num_new_tokens: int) -> int:
        """The block table's length once the next num_new_tokens tokens (after `computed`) have
        slots."""
        return blocks_for(computed + num_new_tokens, self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        table, computed = seq.block_table, seq.num_computed_tokens
        total = self._target_blocks(computed, num_new_tokens)
        return max(0, total - len(table)) + int(self._needs_cow(table, computed))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Make room for seq's next num_new_tokens tokens; returns the block copies to apply.
        Raises OutOfBlocks, changing nothing, when the pool cannot give what it needs."""
        table, computed, bs = seq.block_table, seq.num_computed_tokens, self.block_size
        self._forked.pop(seq.seq_id, None)  # from now on its last block is its own
        if (
            table
            and computed + num_new_tokens <= len(table) * bs
            and (computed % bs == 0 or self.pool.refcount(table[-1]) == 1)
        ):
            # Most decode steps: the next slots are in blocks the sequence owns alone. (A static
            # table holds its reserve from its first allocation on, so this holds there too.)
            return []
        cow = self._needs_cow(table, computed)
        total = self._target_blocks(computed, num_new_tokens)
        need = max(0, total - len(table)) + int(cow)
        free = self.num_free_blocks
        if need > free:
            raise OutOfBlocks(f"sequence {seq.seq_id} needs {need} blocks, {free} available")
        if need > self.pool.num_free:
            assert self.tree is not None
            self.tree.evict(need - self.pool.num_free)
        copies = []
        if cow:
            res = self.pool.cow(table[-1])
            assert res.copy_from is not None
            copies.append(BlockCopy(src=res.copy_from, dst=res.block))
            table[-1] = res.block
        table.extend(self.pool.allocate(max(0, total - len(table))))
        self._changed[seq.seq_id] = seq
        return copies

    def shared_tails(self) -> list[Sequence]:
        """The sequences whose next allocate may copy their last block although their next
        tokens fit in their table (forked, and not allocated since). For every other sequence,
        allocate does nothing while computed + new tokens fit in its blocks: the scheduler
        calls it only for sequences that need more blocks or are listed here."""
        return list(self._forked.values())

    def take_changed(self) -> list[Sequence]:
        """The live sequences whose block tables changed since the last call (allocated,
        copied on write, lent a prefix or forked); freed ones are not reported."""
        changed = list(self._changed.values())
        self._changed.clear()
        return changed

    def cache_progress(self, seq: Sequence) -> None:
        """Publish a running sequence's computed full blocks, so that sequences admitted later hit
        them while it still runs; its lock moves down to the inserted path."""
        if self.tree is None:
            return
        n = seq.num_computed_tokens // self.block_size
        if n == 0:
            return
        inserted = self.tree.insert(tree_key(seq, n * self.block_size), seq.block_table[:n])
        self.tree.lock(inserted.node)
        old = self._locked.pop(seq.seq_id, None)
        if old is not None:
            self.tree.unlock(old)
        self._locked[seq.seq_id] = inserted.node

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's blocks (parallel samples, beams); both must cow to write."""
        assert not child.block_table, "the child must hold no blocks yet"
        self.pool.share(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self._changed[child.seq_id] = child
        self._forked[parent.seq_id] = parent
        self._forked[child.seq_id] = child
        if self.tree is not None and parent.seq_id in self._locked:
            node = self._locked[parent.seq_id]
            self.tree.lock(node)
            self._locked[child.seq_id] = node

    def free(self, seq: Sequence, cache: bool = True) -> None:
        """Release all of seq's blocks; with `cache`, its computed full blocks go into the tree
        first, so that a later request (or this one, after preemption) skips computing them."""
        if self.tree is not None:
            if cache:
                self.cache_progress(seq)
            node = self._locked.pop(seq.seq_id, None)
            if node is not None:
                self.tree.unlock(node)
        self.pool.release(seq.block_table)
        seq.block_table = []
        self._changed.pop(seq.seq_id, None)
        self._forked.pop(seq.seq_id, None)

    def check_integrity(self, live: list[Sequence]) -> None:
        """The pool and tree are consistent and every reference has its holder."""
        self.pool.check_integrity()
        if self.tree is not None:
            self.tree.check_integrity()
        assert set(self._locked) <= {s.seq_id for s in live}, "a lock outlived its sequence"
        assert set(self._forked) <= {s.seq_id for s in live}, "a fork outlived its sequence"
        for seq in live:  # the partly filled block a sequence writes next is shared only by forks
            computed = seq.num_computed_tokens
            if computed % self.block_size and seq.seq_id not in self._forked:
                block = seq.block_table[computed // self.block_size]
                assert self.pool.refcount(block) == 1, f"sequence {seq.seq_id}: shared tail"
        held: dict[int, int] = {}
        for seq in live:
            assert len(seq.block_table) >= blocks_for(seq.num_computed_tokens, self.block_size)
            for b in seq.block_table:
                held[b] = held.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            expected = held.get(b, 0) + int(self.tree is not None and self.tree.holds(b))
            assert self.pool.refcount(b) == expected, f"block {b}: reference leak"


class StaticKVCacheManager(KVCacheManager):
    """The baseline before PagedAttention: a sequence reserves slots for max_model_len tokens when
    it is admitted and holds all of them until it finishes. No sharing, no prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, prefix_caching=False)
        self.reserve = blocks_for(max_model_len, block_size)

    def _target_blocks(self, computed: int, num_new_tokens: int) -> int:
        return max(self.reserve, super()._target_blocks(computed, num_new_tokens))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise ValueError("kv_allocator=static shares no blocks: samples run as separate sequences")
