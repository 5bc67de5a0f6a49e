"""RadixCache: hand-built cases for structure and eviction order, and a hypothesis state machine
that drives the tree with the engine's protocol against a brute-force model (a dict of cached
block-aligned prefixes) and a real BlockPool, checking integrity and exact reference counts after
every operation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from batchpage.cache.block_pool import BlockPool
from batchpage.cache.radix_cache import RadixCache, RadixNode


def put(tree: RadixCache, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens` itself caches them and goes away."""
    blocks = tree.pool.allocate(len(tokens) // tree.block_size)
    tree.insert(tokens, blocks)
    tree.pool.release(blocks)
    tree.check_integrity()
    tree.pool.check_integrity()
    return blocks


def evict_order(tree: RadixCache, names: dict[int, str]) -> list[str]:
    """Names of the blocks evicted, one eviction call per block."""
    order = []
    while tree.cached_blocks:
        r = tree.evict(1)
        assert r.freed_blocks == r.released_blocks  # nobody else holds them here
        order.extend(names[b] for b in r.released_blocks)
        tree.check_integrity()
    return order


# ---- structure --------------------------------------------------------------------------------


def test_match_returns_longest_block_aligned_prefix_and_never_mutates() -> None:
    tree = RadixCache(BlockPool(8), block_size=2)
    blocks = put(tree, [0, 1, 2, 3, 4, 5])
    assert tree.match_prefix([0, 1, 2, 3, 9, 9]).blocks == blocks[:2]
    m = tree.match_prefix([0, 1, 2])  # a partial block never matches
    assert (m.blocks, m.num_tokens) == (blocks[:1], 2)
    m = tree.match_prefix([0, 1, 2, 3, 4, 5], max_tokens=5)  # engine's cap: len(prompt) - 1
    assert (m.blocks, m.num_tokens) == (blocks[:2], 4)
    assert tree.match_prefix([0, 1, 2, 3, 4, 5]).num_tokens == 6
    miss = tree.match_prefix([1, 1])
    assert (miss.blocks, miss.num_tokens, miss.node) == ([], 0, tree.root)
    assert tree.num_nodes == 1  # matching inside a node did not split it
    assert tree.pool.refcount(blocks[0]) == 1  # and took no references
    tree.check_integrity()


def test_insert_splits_on_block_boundaries_and_adopts_only_the_new_part() -> None:
    pool = BlockPool(16)
    tree = RadixCache(pool, block_size=2)
    first = put(tree, [0, 1, 2, 3])
    mine = pool.allocate(3)
    r = tree.insert([0, 1, 2, 9, 7, 7], mine)  # diverges inside the second block
    assert (r.num_cached_tokens, r.num_new_tokens, r.new_blocks) == (2, 4, mine[1:])
    assert tree.num_nodes == 3  # [0,1] -> {[2,3], [2,9,7,7]}
    assert pool.refcount(mine[0]) == 1  # a duplicate of a cached block: still only the caller's
    assert [pool.refcount(b) for b in mine[1:]] == [2, 2]  # caller + tree
    pool.release(mine)
    tree.check_integrity()
    assert tree.match_prefix([0, 1, 2, 3]).blocks == first
    assert tree.match_prefix([0, 1, 2, 9, 7, 7]).blocks == first[:1] + mine[1:]
    # Sharing the first token but not the first block gives a sibling, never a mid-block split.
    put(tree, [0, 2])
    assert tree.num_nodes == 4 and len(tree.root.children) == 2
    # Inserting what is cached already (a prefix ending inside a node) adopts nothing.
    again = pool.allocate(1)
    r = tree.insert([0, 1], again)
    assert (r.num_cached_tokens, r.new_blocks, tree.num_nodes) == (2, [], 4)
    pool.release(again)
    tree.check_integrity()
    pool.check_integrity()


def test_lock_pins_the_path_and_the_handle_survives_a_split() -> None:
    pool = BlockPool(8)
    tree = RadixCache(pool, block_size=1)
    put(tree, [0, 1, 2, 3])
    m = tree.match_prefix([0, 1, 2, 3])
    tree.lock(m.node)
    pool.share(m.blocks)
    assert tree.evictable_blocks == 0
    put(tree, [0, 1, 9])  # splits the locked node above the handle
    assert tree.num_nodes == 3 and tree.evictable_blocks == 1
    r = tree.evict(100)
    assert (r.released_blocks, tree.cached_blocks) == (r.freed_blocks, 4)  # only [9] went
    tree.unlock(m.node)
    pool.release(m.blocks)
    tree.check_integrity()
    assert tree.evict(100).freed_blocks and pool.num_free == pool.num_blocks


def test_evict_counts_only_blocks_that_become_free() -> None:
    pool = BlockPool(8)
    tree = RadixCache(pool, block_size=2)
    x = put(tree, [0, 0, 0, 0])
    y = put(tree, [1, 1])
    pool.share(x)  # a running sequence holds x without a lock (allowed, just wasteful)
    r = tree.evict(1)  # lru: x goes first but frees nothing, so eviction goes on to y
    assert (r.released_blocks, r.freed_blocks, r.num_nodes) == (x + y, y, 2)
    assert tree.evict(1) == ([], [], 0)  # nothing left
    pool.release(x)
    assert pool.num_free == pool.num_blocks


def test_moving_a_lock_deeper_after_an_early_insert() -> None:
    pool = BlockPool(8)
    tree = RadixCache(pool, block_size=1)
    put(tree, [5])
    m = tree.match_prefix([5, 6, 7], max_tokens=2)
    tree.lock(m.node)
    pool.share(m.blocks)
    table = m.blocks + pool.allocate(2)
    r = tree.insert([5, 6], table[:2])  # chunked prefill: cache what is computed so far
    tree.lock(r.node)
    tree.unlock(m.node)
    assert tree.evict(10).released_blocks == [] and tree.cached_blocks == 2
    tree.unlock(r.node)
    pool.release(table)
    tree.evict(10)
    tree.check_integrity()
    assert pool.num_free == pool.num_blocks


def test_misuse_is_refused() -> None:
    pool = BlockPool(8)
    tree = RadixCache(pool, block_size=2)
    with pytest.raises(ValueError, match="policy"):
        RadixCache(pool, block_size=2, policy="mru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="whole blocks"):
        tree.insert([0, 1, 2], pool.allocate(1))
    with pytest.raises(ValueError, match="whole blocks"):
        tree.insert([0, 1], [])
    cached = put(tree, [0, 1])
    with pytest.raises(ValueError, match="already in the tree"):
        tree.insert([3, 3], cached)
    with pytest.raises(ValueError, match="free block"):
        tree.insert([3, 3], [pool.num_blocks - 1])
    m = tree.match_prefix([0, 1])
    with pytest.raises(ValueError, match="unlock"):
        tree.unlock(m.node)
    tree.evict(1)
    with pytest.raises(ValueError, match="evicted"):
        tree.lock(m.node)
    tree.check_integrity()


def test_stale_heap_entries_stay_bounded() -> None:
    pool = BlockPool(4)
    tree = RadixCache(pool, block_size=1)
    put(tree, [1, 2])
    for _ in range(1000):
        m = tree.match_prefix([1, 2])
        tree.lock(m.node)
        tree.unlock(m.node)
    assert len(tree._heap) <= 2 * tree.num_nodes + 65
    tree.check_integrity()


# ---- eviction order ---------------------------------------------------------------------------


def named(tree: RadixCache, **seqs: list[int]) -> dict[int, str]:
    return {b: name for name, tokens in seqs.items() for b in put(tree, tokens)}


def test_lru_evicts_least_recently_used_first() -> None:
    tree = RadixCache(BlockPool(8), block_size=1, policy="lru")
    names = named(tree, a=[0], b=[1], c=[2])
    tree.match_prefix([0])
    assert evict_order(tree, names) == ["b", "c", "a"]


def test_lfu_evicts_least_used_first_and_breaks_ties_by_age() -> None:
    tree = RadixCache(BlockPool(8), block_size=1, policy="lfu")
    names = named(tree, a=[0], b=[1], c=[2], d=[3])
    tree.match_prefix([0])
    tree.match_prefix([0])
    tree.match_prefix([2])  # c is used later than a, but less often
    assert evict_order(tree, names) == ["b", "d", "c", "a"]


def test_fifo_evicts_in_insertion_order_whatever_the_use() -> None:
    tree = RadixCache(BlockPool(8), block_size=1, policy="fifo")
    names = named(tree, a=[0], b=[1], c=[2])
    tree.match_prefix([0])
    tree.match_prefix([0])
    assert evict_order(tree, names) == ["a", "b", "c"]


def test_a_parent_is_evicted_only_after_its_children() -> None:
    tree = RadixCache(BlockPool(8), block_size=1)
    put(tree, [0, 1])
    put(tree, [0, 2])  # splits: [0] -> {[1], [2]}
    root_child = tree.match_prefix([0]).blocks[0]
    tree.match_prefix([0, 1])
    r = tree.evict(3)  # in a single call: [0] becomes a leaf once both children are gone
    assert r.num_nodes == 3 and r.released_blocks[-1] == root_child
    assert tree.match_prefix([0, 2]).blocks == []
    tree.check_integrity()


# ---- property test against a brute-force model ---------------------------------------------


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int]  # the sequence's own references, one per block of its table
    node: RadixNode  # its locked handle
    locked_tokens: int  # the prefix its lock pins


tokens_st = st.lists(st.integers(0, 3), max_size=12)


class RadixMachine(RuleBasedStateMachine):
    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(["lru", "lfu", "fifo"]),
        num_blocks=st.integers(4, 48),
    )
    def setup(self, bs: int, policy: str, num_blocks: int) -> None:
        self.bs = bs
        self.pool = BlockPool(num_blocks)
        self.tree = RadixCache(self.pool, bs, policy)  # type: ignore[arg-type]
        self.model: dict[tuple[int, ...], int] = {}  # cached aligned prefix -> its last block
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the prefix whose KV it holds
        self.running: list[Seq] = []
        self.seen: list[list[int]] = []  # prompts so far, to draw new ones that share prefixes

    # -- helpers --

    def draw_tokens(self, data: st.DataObject) -> list[int]:
        """Mostly a cut of an earlier prompt plus a few random tokens: cache hits, splits, and
        matches that end inside a node are then common."""
        tokens = data.draw(tokens_st)
        if self.seen and data.draw(st.integers(0, 3)):
            base = data.draw(st.sampled_from(self.seen))
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + tokens[: data.draw(st.integers(0, 4))]
        return tokens

    def expected_match(self, tokens: list[int], limit: int) -> list[int]:
        blocks = []
        for end in range(self.bs, limit + 1, self.bs):
            prefix = tuple(tokens[:end])
            if prefix not in self.model:
                break
            blocks.append(self.model[prefix])
        return blocks

    def make_room(self, need: int) -> bool:
        short = need - self.pool.num_free
        if short > 0:
            held = {b for s in self.running for b in s.blocks}
            r = self.tree.evict(short)
            for b in r.released_blocks:
                assert self.model.pop(self.content[b]) == b
            assert set(r.freed_blocks) == {b for b in r.released_blocks if b not in held}
            assert all(self.pool.refcount(b) == 0 for b in r.freed_blocks)
            if len(r.freed_blocks) < short:
                assert self.tree.evictable_blocks == 0  # stopped early only when nothing was left
        return self.pool.num_free >= need

    def allocate_for(self, tokens: list[int], have: int) -> list[int] | None:
        need = -(-len(tokens) // self.bs) - have  # the partial last block too
        if not self.make_room(need):
            return None
        fresh = self.pool.allocate(need)
        for i, b in enumerate(fresh):
            self.content[b] = tuple(tokens[: (have + i + 1) * self.bs])
        return fresh

    def insert(self, tokens: list[int], blocks: list[int]) -> RadixNode:
        expected_cached = len(self.expected_match(tokens, len(tokens)))
        r = self.tree.insert(tokens, blocks)
        assert r.num_cached_tokens == expected_cached * self.bs
        assert r.new_blocks == blocks[expected_cached:]
        for i, b in enumerate(blocks):
            self.model.setdefault(tuple(tokens[: (i + 1) * self.bs]), b)
        return r.node

    # -- rules --

    @rule(data=st.data(), cap=st.booleans())
    def match_only(self, data: st.DataObject, cap: bool) -> None:
        tokens = self.draw_tokens(data)
        limit = max(0, len(tokens) - 1) if cap else len(tokens)
        m = self.tree.match_prefix(tokens, max_tokens=limit if cap else None)
        want = self.expected_match(tokens, limit - limit % self.bs)
        assert (m.blocks, m.num_tokens) == (want, len(want) * self.bs)
        for i, b in enumerate(m.blocks):
            assert self.content[b] == tuple(tokens[: (i + 1) * self.bs])

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data) or [0]
        self.seen.append(tokens)
        m = self.tree.match_prefix(tokens, max_tokens=len(tokens) - 1)
        want = self.expected_match(tokens, (len(tokens) - 1) // self.bs * self.bs)
        assert m.blocks == want
        self.tree.lock(m.node)
        self.pool.share(m.blocks)
        fresh = self.allocate_for(tokens, len(m.blocks))
        if fresh is None:  # the pool is too small: give up as the engine would (no admission)
            self.tree.unlock(m.node)
            self.pool.release(m.blocks)
            return
        self.running.append(Seq(tokens, m.blocks + fresh, m.node, m.num_tokens))

    @rule(data=st.data())
    def compute_and_cache(self, data: st.DataObject) -> None:
        tokens = self.draw_tokens(data)
        self.seen.append(tokens)
        tokens = tokens[: len(tokens) - len(tokens) % self.bs]
        fresh = self.allocate_for(tokens, 0)
        if fresh is None:
            return
        self.insert(tokens, fresh)
        self.pool.release(fresh)

    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        if not self.running:
            return
        seq = self.running.pop(pick % len(self.running))
        full = len(seq.tokens) // self.bs
        self.insert(seq.tokens[: full * self.bs], seq.blocks[:full])
        self.tree.unlock(seq.node)
        self.pool.release(seq.blocks)

    @rule(pick=st.integers(0, 100), upto=st.integers(0, 100))
    def cache_early(self, pick: int, upto: int) -> None:
        if not self.running:
            return
        seq = self.running[pick % len(self.running)]
        k = upto % (len(seq.tokens) // self.bs + 1)
        node = self.insert(seq.tokens[: k * self.bs], seq.blocks[:k])
        self.tree.lock(node)
        self.tree.unlock(seq.node)
        seq.node, seq.locked_tokens = node, k * self.bs

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        self.make_room(self.pool.num_free + n)

    # -- after every rule --

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        self.pool.check_integrity()
        assert self.tree.cached_blocks == len(self.model)
        in_tree = set(self.model.values())
        for b in range(self.pool.num_blocks):
            holders = (b in in_tree) + sum(s.blocks.count(b) for s in self.running)
            assert self.pool.refcount(b) == holders, f"block {b}: leaked or over-released"
        for s in self.running:
            for end in range(self.bs, s.locked_tokens + 1, self.bs):
                assert tuple(s.tokens[:end]) in self.model, "a locked prefix was evicted"

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for seq in self.running:
            self.tree.unlock(seq.node)
            self.pool.release(seq.blocks)
        self.tree.evict(self.pool.num_blocks)
        self.tree.check_integrity()
        assert self.tree.cached_blocks == 0 and self.tree.evictable_blocks == 0
        assert self.pool.num_free == self.pool.num_blocks


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
test_radix_cache_against_model = RadixMachine.TestCase
