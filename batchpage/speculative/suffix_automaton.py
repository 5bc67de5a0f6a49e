"""SuffixAutomaton: the substrings of a set of token sequences, with occurrence counts of every
substring up to a maximum depth; the structure behind suffix decoding (suffix.py).

Why a suffix automaton (Blumer et al.'s DAWG, generalized to several documents) rather than the
textbook depth-limited suffix trie or a hash of n-gram contexts: those keep one entry per token
per context length (tokens x max_depth entries), and the workloads suffix decoding is for (an
output that copies its prompt, rows that repeat each other) are exactly where every context is
new, so they reach that bound. The automaton has at most two states per token whatever the text,
adding a token costs amortized O(1) structural work plus one count update per state the new
token's short suffixes fall in (at most max_depth, a handful on natural text), and a state is
one transition dict plus three list slots.

Terms. A state is a class of substrings with the same set of end positions (`endpos`); its strings
are the suffixes of its longest one with lengths in (length[link[s]], length[s]]. Following
`next` from the root spells any substring and lands in its class. count[s] is |endpos(s)|, the
number of occurrences of each of its strings over all documents, kept for every state whose
shortest string is at most max_depth long (other states' counts are stale and never read). The
occurrence counts of x + t for each token t are then count[next[s][t]], the statistics suffix
decoding drafts from.

Documents are only added, token by token, each through its own `Cursor` (documents may grow
interleaved); nothing is removed: a cache drops a whole automaton to evict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0


@dataclass(slots=True)
class Cursor:
    """Where a document being added stands: `last`, the state of the whole document so far;
    `deep`, the state of its last min(size, max_depth) tokens; `size`, its length."""

    last: int = ROOT
    deep: int = ROOT
    size: int = 0


class SuffixAutomaton:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"a suffix automaton needs max_depth >= 1; got {max_depth}")
        self.max_depth = max_depth
        self.length: list[int] = [0]
        self.link: list[int] = [-1]
        self.count: list[int] = [0]
        self.next: list[dict[int, int]] = [{}]
        self.num_tokens = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    def extend(self, cursor: Cursor, tokens: Sequence[int]) -> None:
        """Append tokens to the document `cursor` stands for (a new Cursor() starts one)."""
        for t in tokens:
            self._add(cursor, t)

    def _add(self, cursor: Cursor, token: int) -> None:
        length, link, count = self.length, self.link, self.count
        cursor.last = self._grow(cursor.last, token)
        # The class of the document's old suffix of length min(size, max_depth - 1): `deep`
        # held one a token longer (or the same), and a clone made by _grow may now sit between
        # them on the link chain; either way it is one or two links up.
        keep = min(cursor.size, self.max_depth - 1)
        s = cursor.deep
        while s != ROOT and length[link[s]] >= keep:
            s = link[s]
        s = self.next[s][token]
        cursor.deep = s
        cursor.size += 1
        self.num_tokens += 1
        # One more occurrence for every suffix of at most max_depth tokens: the classes on the
        # link chain from `deep` to the root (longer suffixes' counts are never read).
        while s != ROOT:
            count[s] += 1
            s = link[s]

    def _grow(self, last: int, token: int) -> int:
        """The generalized automaton's online step: the state of (last's longest string) + token,
        made if needed, with the links and transitions of every other state kept exact."""
        length, link, nxt = self.length, self.link, self.next
        q = nxt[last].get(token)
        if q is not None:  # the extended string already occurs (in another document)
            if length[q] == length[last] + 1:
                return q
            clone = self._clone(q, length[last] + 1)
            p = last
            while p != -1 and nxt[p].get(token) == q:
                nxt[p][token] = clone
                p = link[p]
            return clone
        cur = self._state(length[last] + 1, ROOT, 0, {})
        p = last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._clone(q, length[p] + 1)
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[cur] = clone
        return cur

    def _state(self, length: int, link: int, count: int, nxt: dict[int, int]) -> int:
        self.length.append(length)
        self.link.append(link)
        self.count.append(count)
        self.next.append(nxt)
        return len(self.length) - 1

    def _clone(self, q: int, length: int) -> int:
        # The clone takes q's strings of at most `length` tokens; they occur wherever q's do (the
        # occurrence being added is counted afterwards, along the new link chain).
        clone = self._state(length, self.link[q], self.count[q], dict(self.next[q]))
        self.link[q] = clone
        return clone

    def suffix_state(self, cursor: Cursor, size: int) -> int:
        """The state of the document's last `size` tokens (size <= min(cursor.size, max_depth))."""
        if not 0 <= size <= min(cursor.size, self.max_depth):
            raise ValueError(f"suffix of {size} tokens: the document has {cursor.size}")
        length, link = self.length, self.link
        s = cursor.deep
        while s != ROOT and length[link[s]] >= size:
            s = link[s]
        return s

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(state, n): the longest suffix of `tokens` that occurs in the documents is its last n
        tokens, and `state` is its class (the root when n is 0). Costs O(len(tokens))."""
        length, link, nxt = self.length, self.link, self.next
        s, n = ROOT, 0
        for t in tokens:
            while s != ROOT and t not in nxt[s]:
                s = link[s]
                n = length[s]
            u = nxt[s].get(t)
            if u is None:
                n = 0
            else:
                s = u
                n += 1
        return s, n

    def check_integrity(self, documents: Sequence[Sequence[int]]) -> None:
        """The automaton holds exactly `documents` (the token lists added, in any order): its
        paths of at most max_depth tokens from the root spell exactly their substrings, each
        ends in a state whose length range holds it and whose count is its number of
        occurrences, and every link and length is consistent. Brute force: O(tokens x depth^2)."""
        n = self.num_states
        assert len(self.link) == len(self.count) == len(self.next) == n, "state lists differ"
        assert self.link[ROOT] == -1 and self.length[ROOT] == 0, "bad root"
        assert self.num_tokens == sum(len(d) for d in documents), "token total is stale"
        for s in range(1, n):
            assert 0 <= self.link[s] < n, f"state {s}: bad link"
            assert self.length[self.link[s]] < self.length[s], f"state {s}: link not shorter"
        for s in range(n):
            for t, u in self.next[s].items():
                assert 0 < u < n, f"state {s}: transition to a missing state"
                assert self.length[u] >= self.length[s] + 1, f"state {s} -{t}-> {u}: too short"
        depth = self.max_depth
        occurrences: dict[tuple[int, ...], int] = {}
        for doc in documents:
            for i in range(len(doc)):
                for j in range(i + 1, min(len(doc), i + depth) + 1):
                    key = tuple(doc[i:j])
                    occurrences[key] = occurrences.get(key, 0) + 1
        for text, expected in occurrences.items():
            s = ROOT
            for t in text:
                assert t in self.next[s], f"substring {text} is not spelled"
                s = self.next[s][t]
            assert self.length[self.link[s]] < len(text) <= self.length[s], f"{text}: bad class"
            assert self.count[s] == expected, f"{text}: count {self.count[s]} != {expected}"
        paths, stack = 0, [(ROOT, 0)]
        while stack:
            s, d = stack.pop()
            if d < depth:
                paths += len(self.next[s])
                stack.extend((u, d + 1) for u in self.next[s].values())
        assert paths == len(occurrences), f"{paths} paths spell {len(occurrences)} substrings"
