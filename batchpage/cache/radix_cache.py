"""RadixCache: a radix tree over token ids whose nodes hold KV block ids (RadixAttention).

What is cached: block-aligned token prefixes. A node's `key` is a run of tokens whose length is a
multiple of block_size, and `blocks[i]` holds the KV of key[i*bs:(i+1)*bs] given everything above it
on the path. KV depends on the whole prefix, so a block id sits at exactly one place in the tree.
Children are keyed by their first block of tokens, so every split falls on a block boundary.

Ownership (see block_pool.py): the tree is one holder. It owns exactly one pool reference per block
it lists, taken in `insert` (pool.share) and given back in `evict` (pool.release). No other method
touches reference counts; match_prefix and lock take none.

The engine's protocol, per sequence:

1. m = cache.match_prefix(prompt, max_tokens=len(prompt) - 1)
   match_prefix returns whatever is cached; the cap is the engine's job and keeps at least one
   prompt token to compute, whose logits give the first output token.
2. cache.lock(m.node) at once, before any insert or evict: an unlocked node may be evicted, and lock
   refuses an evicted node. The lock pins the whole path root..node, which may be a few blocks more
   than m.blocks when the match ended inside a node.
3. pool.share(m.blocks): the sequence's block table is a holder of its own, one reference per
   block. The rest of the table comes from pool.allocate; when pool.num_free is short, call
   cache.evict(shortfall) first, and preempt if that still is not enough.
4. When the sequence finishes or is preempted: cache.insert(tokens[:n], table[:n // bs]), n
   being the number of tokens whose KV is written, rounded down to whole blocks; then
   cache.unlock(m.node); then pool.release(table), all of the sequence's own references. The tree
   keeps its references to what it adopted; the sequence's duplicates of blocks that were already
   cached go back to the pool.
   A running sequence may also insert early (chunked prefill) and move its lock deeper:
   r = cache.insert(...); cache.lock(r.node); cache.unlock(old_node).

Handles: a RadixNode stays valid across splits (a split puts a new node above it and copies its lock
count there), so m.node can be unlocked after inserts. Treat it as opaque. The root is the handle of
an empty match; locking or unlocking it does nothing, since the root is never evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, get_args

from batchpage.cache.block_pool import BlockPool

EvictionPolicy = Literal["lru", "lfu", "fifo"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)  # for config validation


class RadixNode:
    __slots__ = (
        "key", "blocks", "parent", "children", "lock_ref", "own_locks",
        "last_access", "hits", "created", "alive",
    )  # fmt: skip

    def __init__(
        self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None, now: int
    ) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}  # first block of tokens -> child
        self.lock_ref = 0  # locks on this node and on all nodes below it
        self.own_locks = 0  # lock() calls on this very node, to check unlock() and the sums
        self.last_access = now  # lru; also breaks lfu ties
        self.hits = 0  # lfu: match_prefix calls that used this node
        self.created = now  # fifo
        self.alive = True


class PrefixMatch(NamedTuple):
    blocks: list[int]  # the tree's blocks of tokens [0, num_tokens); the caller shares them
    num_tokens: int  # a multiple of block_size
    node: RadixNode  # handle for lock/unlock; the root when nothing matched


class InsertResult(NamedTuple):
    num_cached_tokens: int  # leading tokens already in the tree: nothing adopted for them
    num_new_tokens: int  # tokens the tree newly caches
    new_blocks: list[int]  # blocks adopted for them; the tree took one reference to each
    node: RadixNode  # the deepest node on the inserted path (to move a lock there)


class EvictResult(NamedTuple):
    freed_blocks: list[int]  # blocks that went back to the pool's free list
    released_blocks: list[int]  # every block the tree let go of (freed or still held elsewhere)
    num_nodes: int  # nodes removed


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int, policy: EvictionPolicy = "lru") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        priorities: dict[str, Callable[[RadixNode], tuple[int, ...]]] = {
            "lru": lambda n: (n.last_access,),
            "lfu": lambda n: (n.hits, n.last_access),
            "fifo": lambda n: (n.created,),
        }
        if policy not in priorities:
            raise ValueError(f"unknown eviction policy {policy!r}; use one of {list(priorities)}")
        self.pool = pool
        self.block_size = block_size
        self.policy = policy
        self._priority = priorities[policy]
        self._clock = 0  # a counter, not wall time: deterministic order and no ties within a call
        self.root = RadixNode((), [], None, 0)
        # Eviction candidates, invalidated lazily: an entry counts only while its node is still an
        # unlocked leaf with the same priority. Every such leaf has at least one valid entry.
        self._heap: list[tuple[tuple[int, ...], int, RadixNode]] = []
        self._serial = itertools.count()  # heap tie-breaker, so nodes are never compared
        self._held: set[int] = set()  # blocks the tree holds one pool reference to
        self._evictable = 0  # blocks in unlocked nodes
        self._num_nodes = 0  # excluding the root

    # ---- read-only stats -------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        return len(self._held)

    @property
    def evictable_blocks(self) -> int:
        """Blocks in unlocked nodes. Evicting frees those no sequence still holds, which under the
        protocol above (a sequence locks whatever tree blocks it holds) is all of them."""
        return self._evictable

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def holds(self, block: int) -> bool:
        """Whether the tree owns a reference to this block."""
        return block in self._held

    # ---- interface -------------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached block-aligned prefix of token_ids[:max_tokens].

        Never changes the tree's structure and takes no references. It does count as a use for
        the eviction policy: the matched nodes get a fresh access time and one more hit.
        """
        tokens = tuple(token_ids)
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        path, num_tokens = self._descend(tokens, limit)
        now = self._tick()
        blocks: list[int] = []
        for node, n in path:
            blocks.extend(node.blocks[:n])
            node.last_access = now
            node.hits += 1
            self._push(node)
        return PrefixMatch(blocks, num_tokens, path[-1][0] if path else self.root)

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> InsertResult:
        """Cache whole blocks: blocks[i] holds tokens [i*bs, (i+1)*bs) of token_ids. The result's
        node ends exactly at len(token_ids) (a node is split there if needed).

        The leading part already in the tree adopts nothing: the caller keeps its own references
        there. The tree takes one new reference (pool.share) to each block of the new part. The
        caller's references are untouched either way; it releases them when it is done.
        """
        tokens, bs = tuple(token_ids), self.block_size
        if len(tokens) % bs or len(blocks) != len(tokens) // bs:
            raise ValueError(
                f"insert takes whole blocks: {len(tokens)} tokens, {len(blocks)} blocks, bs={bs}"
            )
        path, num_cached = self._descend(tokens, len(tokens))
        new_blocks = list(blocks[num_cached // bs :])
        # Check before mutating anything: a block caches one position, and must be held already.
        if len(set(new_blocks)) != len(new_blocks) or any(b in self._held for b in new_blocks):
            raise ValueError(f"blocks {new_blocks} repeat or are already in the tree")
        if any(self.pool.refcount(b) < 1 for b in new_blocks):
            raise ValueError(f"blocks {new_blocks} include a free block")
        now = self._tick()
        node = self.root
        for child, n in path:
            if n < len(child.blocks):
                # Split at the end of what was inserted: a new branch hangs at a block boundary,
                # and the returned node covers exactly token_ids, so locking it pins no more.
                child = self._split(child, n)
            child.last_access = now
            node = child
        if new_blocks:
            self.pool.share(new_blocks)
            leaf = RadixNode(tokens[num_cached:], new_blocks, node, now)
            node.children[leaf.key[:bs]] = leaf
            self._held.update(new_blocks)
            self._evictable += len(new_blocks)
            self._num_nodes += 1
            node = leaf
        self._push(node)
        return InsertResult(num_cached, len(tokens) - num_cached, new_blocks, node)

    def lock(self, node: RadixNode) -> None:
        """Pin node and its ancestors against eviction; pairs with exactly one unlock(node)."""
        if not node.alive:
            raise ValueError("node was evicted: lock it right after match_prefix")
        if node is self.root:
            return
        node.own_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        if node is self.root:
            return
        if node.own_locks == 0:
            raise ValueError("unlock without a matching lock on this node")
        node.own_locks -= 1
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.blocks)
                self._push(node)
            node = node.parent

    def evict(self, num_blocks: int) -> EvictResult:
        """Release unlocked leaves, lowest policy priority first, until num_blocks blocks are free.

        Whole nodes go, so more than num_blocks may be freed. A released block that a sequence
        still holds does not become free and does not count; eviction goes on past it. Stops
        early when nothing is evictable.
        """
        freed: list[int] = []
        released: list[int] = []
        num_nodes = 0
        while len(freed) < num_blocks and self._heap:
            key, _, node = heapq.heappop(self._heap)
            if not self._is_candidate(node) or key != self._priority(node):
                continue  # stale entry
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.block_size]]
            node.alive, node.parent = False, None
            released.extend(node.blocks)
            freed.extend(self.pool.release(node.blocks))
            self._held.difference_update(node.blocks)
            self._evictable -= len(node.blocks)
            self._num_nodes -= 1
            num_nodes += 1
            self._push(parent)  # it may have just become a leaf
        return EvictResult(freed, released, num_nodes)

    def check_integrity(self) -> None:
        bs, seen, evictable, num_nodes = self.block_size, [], 0, 0
        assert not self.root.key and not self.root.blocks, "the root caches nothing"
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert node.alive, "a dead node is still in the tree"
            for first, child in node.children.items():
                assert child.parent is node, "child's parent link is wrong"
                assert child.key[:bs] == first, "child filed under the wrong first block"
                assert child.key and len(child.key) % bs == 0, "node key not block-aligned"
                assert len(child.key) == len(child.blocks) * bs, "node key/blocks length mismatch"
            if node is not self.root:
                num_nodes += 1
                below = sum(c.lock_ref for c in node.children.values())
                assert node.lock_ref == node.own_locks + below, "lock_ref != own locks + children"
                evictable += 0 if node.lock_ref else len(node.blocks)
                seen.extend(node.blocks)
            stack.extend(node.children.values())
        assert len(seen) == len(set(seen)), "a block sits at two places in the tree"
        assert set(seen) == self._held, "the tree's reference bookkeeping disagrees with its nodes"
        for b in seen:
            assert self.pool.refcount(b) >= 1, f"block {b} is in the tree but free in the pool"
        assert evictable == self._evictable, "evictable block count is off"
        assert num_nodes == self._num_nodes, "node count is off"
        valid = {id(n) for key, _, n in self._heap if self._is_valid(key, n)}
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert not self._is_candidate(node) or id(node) in valid, "leaf missing from the heap"
            stack.extend(node.children.values())

    # ---- internals -------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _descend(
        self, tokens: tuple[int, ...], limit: int
    ) -> tuple[list[tuple[RadixNode, int]], int]:
        """Walk tokens[:limit] block by block: (node, blocks matched in it) from the top down,
        and the number of tokens matched. Only the last node can be matched partly."""
        bs, node, pos = self.block_size, self.root, 0
        path: list[tuple[RadixNode, int]] = []
        while pos + bs <= limit:
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            n, most = 1, min(len(child.blocks), (limit - pos) // bs)
            at = pos + n * bs
            while n < most and child.key[n * bs : (n + 1) * bs] == tokens[at : at + bs]:
                n, at = n + 1, at + bs
            path.append((child, n))
            pos += n * bs
            if n < len(child.blocks):
                break
            node = child
        return path, pos

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node after n blocks. The new upper part goes above it, so handles to node stay
        valid; it inherits node's lock count (every lock through node passes it) and stats."""
        bs, parent = self.block_size, node.parent
        assert parent is not None and 0 < n < len(node.blocks)
        upper = RadixNode(node.key[: n * bs], node.blocks[:n], parent, node.created)
        upper.last_access, upper.hits, upper.lock_ref = node.last_access, node.hits, node.lock_ref
        parent.children[upper.key[:bs]] = upper
        node.key, node.blocks, node.parent = node.key[n * bs :], node.blocks[n:], upper
        upper.children[node.key[:bs]] = node
        self._num_nodes += 1
        return upper

    def _is_candidate(self, node: RadixNode) -> bool:
        return node.alive and node is not self.root and not node.children and node.lock_ref == 0

    def _is_valid(self, key: tuple[int, ...], node: RadixNode) -> bool:
        return self._is_candidate(node) and key == self._priority(node)

    def _push(self, node: RadixNode) -> None:
        if not self._is_candidate(node):
            return
        heapq.heappush(self._heap, (self._priority(node), next(self._serial), node))
        # Stale entries pile up with every touch and unlock; rebuild once they outnumber nodes.
        if len(self._heap) > 2 * self._num_nodes + 64:
            live = {id(n): (k, s, n) for k, s, n in self._heap if self._is_valid(k, n)}
            self._heap = list(live.values())
            heapq.heapify(self._heap)
