"""NgramDrafter: prompt lookup (vLLM's "ngram" method) over each sequence's own tokens, for a
whole batch of sequences at once.

The rule, vLLM's (v1/spec_decode/ngram_proposer.py): take the longest n in
[prompt_lookup_min, prompt_lookup_max] whose last n tokens of the sequence (prompt and output)
also occur earlier in it, ending before its last token; of those earlier occurrences take the
EARLIEST; propose the tokens that followed it, up to k, cut at the sequence's end. Occurrences may
overlap the last n tokens.

Why the earliest, as vLLM does: the drafts are then vLLM's own, so acceptance measured here
compares with vLLM's n-gram method on the same workload; the earliest occurrence has the most
tokens after it (in a repetition loop the latest one ends a period before the end, leaving only a
period's worth to propose).

Columnar: every sequence's tokens are a row of one token matrix (padded with -1, which no token
equals), and a step's calls take arrays of keys (`append_many`, `propose_many`), so a step runs
the same Python at any batch size. A proposal compares the matrix with each row's last token in
one pass (over the matrix in place, the rows not asked for compared with a value no token
equals): where the token before a position equals it, that position may end an occurrence; each
further length n checks only those candidates, and per row the longest n and then its earliest
candidate win. Its numpy work is linear in the rows' lengths (as vLLM's per-row scan), its
Python constant. Keys map to matrix rows through a sorted key array (a vectorised
searchsorted); a key's row is taken at start and freed at finish.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchpage.speculative.drafter import token_list

_PAD = -1  # the token matrix past each row's tokens
_NONE = -2  # compared with the rows a proposal does not ask for: equals no token nor _PAD


class NgramDrafter:
    """The Drafter contract (drafter.py) over a token matrix. Token ids are in [0, 2**31) (they
    are stored as int32, after -1's padding); others are a ValueError."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "ngram drafter needs 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # The sequences' keys, sorted, and the matrix row of each (same order).
        self._keys = np.zeros(0, dtype=np.int64)
        self._slots = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []  # matrix rows no key holds
        # Row s holds its sequence's tokens [0, _len[s]), then -1. One column at least, for
        # the drafts' gather.
        self._tokens = np.full((0, 1), _PAD, dtype=np.int32)
        self._len = np.zeros(0, dtype=np.int64)

    @property
    def num_sequences(self) -> int:
        return len(self._keys)

    # ---- the contract -------------------------------------------------------------------------

    def start(
        self, key: int, prompt_token_ids: Sequence[int], prompt_len: int | None = None
    ) -> None:
        del prompt_len  # prompt lookup matches over all of a sequence's tokens alike
        tokens = token_list(prompt_token_ids)
        at = int(np.searchsorted(self._keys, key))
        if at < len(self._keys) and self._keys[at] == key:  # a restart: the row is replaced
            slot = int(self._slots[at])
        else:
            slot = self._take_slot()
            self._keys = np.insert(self._keys, at, key)
            self._slots = np.insert(self._slots, at, slot)
        self._clear(slot)
        row = np.array(tokens, dtype=np.int64).reshape(1, -1)
        self._write(np.array([slot]), row, np.array([len(tokens)]))

    def append(self, key: int, tokens: Sequence[int]) -> None:
        new = np.asarray(token_list(tokens), dtype=np.int64)
        self.append_many(np.array([key]), new.reshape(1, -1), np.array([len(new)]))

    def append_many(self, keys: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Key keys[i] (distinct) takes tokens[i, : counts[i]], in order."""
        slots = self._slots_of(keys)
        self._write(slots, np.asarray(tokens, dtype=np.int64), np.asarray(counts, dtype=np.int64))

    def propose(self, key: int, k: int) -> np.ndarray:
        drafts, counts = self.propose_many(np.array([key]), np.array([k]))
        return drafts[0, : counts[0]]

    def propose_many(
        self, keys: Sequence[int] | np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        ks = np.asarray(k, dtype=np.int64).reshape(-1)
        if len(ks) != len(keys):
            raise ValueError(f"propose_many: {len(keys)} keys but {len(ks)} values of k")
        slots = self._slots_of(keys)
        width = max(int(ks.max()), 0) if len(ks) else 0
        start, found = self._earliest_longest(slots)
        counts = np.where(found, np.minimum(ks, self._len[slots] - start), 0).clip(0)
        pos = np.minimum(start[:, None] + np.arange(width), self._tokens.shape[1] - 1)
        drafts = self._tokens[slots[:, None], pos].astype(np.int64)
        drafts[np.arange(width) >= counts[:, None]] = 0
        return drafts, counts

    def finish(self, key: int, token_ids: Sequence[int] | None = None) -> None:
        del token_ids  # nothing is learned from a finished sequence
        at = int(np.searchsorted(self._keys, key))
        if at == len(self._keys) or self._keys[at] != key:
            raise KeyError(f"ngram drafter: sequence {key} was not started")
        slot = int(self._slots[at])
        self._keys = np.delete(self._keys, at)
        self._slots = np.delete(self._slots, at)
        self._clear(slot)
        self._free.append(slot)

    def drop(self, key: int) -> None:
        self.finish(key)  # prompt lookup learns nothing across sequences

    def learn(self, output_token_ids: Sequence[int]) -> None:
        del output_token_ids  # prompt lookup learns nothing across sequences

    # ---- the matrix ---------------------------------------------------------------------------

    def _take_slot(self) -> int:
        if not self._free:
            old = len(self._len)
            grown = max(2 * old, 4)
            tokens = np.full((grown, self._tokens.shape[1]), _PAD, dtype=np.int32)
            tokens[:old] = self._tokens
            self._tokens = tokens
            self._len = np.concatenate([self._len, np.zeros(grown - old, dtype=np.int64)])
            self._free = list(range(grown - 1, old - 1, -1))
        return self._free.pop()

    def _slots_of(self, keys: np.ndarray) -> np.ndarray:
        """The matrix rows of keys (a KeyError names the first key not started)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        at = np.minimum(np.searchsorted(self._keys, keys), max(len(self._keys) - 1, 0))
        known = self._keys[at] == keys if len(self._keys) else np.zeros(len(keys), dtype=bool)
        if not known.all():
            missing = int(keys[np.argmin(known)])
            raise KeyError(f"ngram drafter: sequence {missing} was not started")
        return self._slots[at]

    def _clear(self, slot: int) -> None:
        self._tokens[slot, : self._len[slot]] = _PAD
        self._len[slot] = 0

    def _write(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Row slots[i] takes tokens[i, : counts[i]] after its tokens."""
        if len(counts) and not 0 <= int(counts.min()) <= int(counts.max()) <= tokens.shape[1]:
            raise ValueError(f"ngram drafter: counts must be in [0, {tokens.shape[1]}]")
        take = np.arange(tokens.shape[1]) < counts[:, None]
        new = tokens[take]
        if len(new) and not (int(new.min()) >= 0 and int(new.max()) < 2**31):
            raise ValueError("ngram drafter: token ids must be in [0, 2**31)")
        lens = self._len[slots]
        need = int((lens + counts).max()) if len(slots) else 0
        if need > self._tokens.shape[1]:
            width = max(need, 2 * self._tokens.shape[1])
            wider = np.full((len(self._len), width), _PAD, dtype=np.int32)
            wider[:, : self._tokens.shape[1]] = self._tokens
            self._tokens = wider
        rows = np.broadcast_to(slots[:, None], take.shape)
        cols = lens[:, None] + np.arange(tokens.shape[1])
        self._tokens[rows[take], cols[take]] = new
        self._len[slots] = lens + counts

    def _earliest_longest(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of slots: where its draft starts (the end of the earliest occurrence of the
        longest matching n-gram), and whether one matched."""
        lens = self._len
        asked = np.zeros(len(lens), dtype=bool)
        asked[slots] = True
        asked &= lens > 0
        span = max(int(lens[asked].max()) if asked.any() else 0, 1)
        tokens = self._tokens
        last = np.full(len(lens), _NONE, dtype=np.int32)
        last[asked] = tokens[asked, lens[asked] - 1]
        # Candidates: an occurrence ending at `at` (exclusive, 1 <= at < len) whose last token is
        # the row's last token (a row's own last token is one at == len, dropped; past it the
        # padding equals nothing). np.nonzero lists them by row, then `at` ascending.
        row, at = np.nonzero(tokens[:, : span - 1] == last[:, None])
        at += 1
        end = lens[row]
        keep = at < end
        row, at, end = row[keep], at[keep], end[keep]
        run = np.ones(len(row), dtype=np.int64)  # matching length, up to max_n
        alive = np.ones(len(row), dtype=bool)
        for n in range(2, self.max_n + 1):
            # at < len, so where at - n >= 0 the row's own (len - n)-th token exists too.
            alive &= at >= n
            alive &= tokens[row, np.maximum(at - n, 0)] == tokens[row, np.maximum(end - n, 0)]
            run += alive
        longest = np.zeros(len(lens), dtype=np.int64)
        np.maximum.at(longest, row, run)
        found = longest >= self.min_n
        # The earliest candidate of each row as long as its longest: the first in list order.
        best = run >= longest[row]
        best &= found[row]
        row, at = row[best], at[best]
        first = np.ones(len(row), dtype=bool)
        first[1:] = row[1:] != row[:-1]
        start = np.zeros(len(lens), dtype=np.int64)
        start[row[first]] = at[first]
        return start[slots], found[slots]

    def check_integrity(self) -> None:
        """Keys sorted and distinct, each with its own matrix row; the other rows free and
        empty; every length within the matrix, the tokens padded with -1."""
        keys, slots = self._keys, self._slots
        assert len(keys) == len(slots), "keys and rows differ in number"
        assert (np.diff(keys) > 0).all(), "keys not sorted and distinct"
        held = slots.tolist()
        assert len(set(held)) == len(held), "two keys share a row"
        assert not set(held) & set(self._free), "a held row is free"
        assert len(held) + len(self._free) == len(self._len), "a row lost"
        assert not self._len[self._free].any(), "a free row holds tokens"
        assert (self._len <= self._tokens.shape[1]).all(), "a length past the matrix"
        inside = np.arange(self._tokens.shape[1]) < self._len[:, None]
        assert (self._tokens[inside] >= 0).all(), "a token below 0"
        assert (self._tokens[~inside] == _PAD).all(), "padding overwritten"
