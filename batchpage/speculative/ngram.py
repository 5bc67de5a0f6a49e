"""NgramDrafter: prompt lookup (vLLM's "ngram" method) over each sequence's own tokens.

The rule, vLLM's (v1/spec_decode/ngram_proposer.py): take the longest n in
[prompt_lookup_min, prompt_lookup_max] whose last n tokens of the sequence (prompt and output)
also occur earlier in it, ending before its last token; of those earlier occurrences take the
EARLIEST; propose the tokens that followed it, up to k, cut at the sequence's end. Occurrences may
overlap the last n tokens.

Why the earliest, as vLLM does: the drafts are then vLLM's own, so acceptance measured here
compares with vLLM's n-gram method on the same workload; the earliest occurrence has the most
tokens after it (in a repetition loop the latest one ends a period before the end, leaving only a
period's worth to propose); and its index entry is written once and never moves.

Cost: an index per sequence, a dict from each n-gram (one tuple per length per token) to the end
of its earliest occurrence, written as tokens arrive; a proposal is at most one dict lookup per n.
Neither grows with the sequence's length. All state of a sequence is dropped at finish.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchpage.speculative.drafter import drafts_array, token_list


class NgramDrafter:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "ngram drafter needs 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._tokens: dict[int, list[int]] = {}
        # key -> {n-gram: end (exclusive) of its earliest occurrence}; n-grams of every length
        # share one dict (tuples of different lengths never compare equal).
        self._first: dict[int, dict[tuple[int, ...], int]] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)

    def start(self, key: int, prompt_token_ids: Sequence[int]) -> None:
        self._tokens[key] = []
        self._first[key] = {}
        self._extend(key, token_list(prompt_token_ids))

    def append(self, key: int, tokens: Sequence[int]) -> None:
        if key not in self._tokens:
            raise KeyError(f"ngram drafter: sequence {key} was not started")
        self._extend(key, token_list(tokens))

    def _extend(self, key: int, new: list[int]) -> None:
        tokens, first = self._tokens[key], self._first[key]
        low, high = self.min_n, self.max_n
        for t in new:
            tokens.append(t)
            end = len(tokens)
            for n in range(low, min(high, end) + 1):
                first.setdefault(tuple(tokens[end - n :]), end)

    def _draft(self, key: int, k: int) -> list[int]:
        tokens = self._tokens.get(key)
        if tokens is None:
            raise KeyError(f"ngram drafter: sequence {key} was not started")
        end = len(tokens)
        if k <= 0:
            return []
        first = self._first[key]
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            # The last n-gram itself is indexed, so the lookup always hits; an earlier
            # occurrence exists when its earliest end is before the sequence's end.
            at = first[tuple(tokens[end - n :])]
            if at < end:
                return tokens[at : at + k]
        return []

    def propose(self, key: int, k: int) -> np.ndarray:
        return np.array(self._draft(key, k), dtype=np.int64)

    def propose_many(self, keys: list[int], k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return drafts_array(self._draft, keys, k)

    def finish(self, key: int) -> None:
        if key not in self._tokens:
            raise KeyError(f"ngram drafter: sequence {key} was not started")
        del self._tokens[key], self._first[key]

    def check_integrity(self) -> None:
        """Each sequence's index is exactly its n-grams' earliest ends, rebuilt from scratch."""
        assert self._tokens.keys() == self._first.keys(), "tokens and index keys differ"
        for key, tokens in self._tokens.items():
            expected: dict[tuple[int, ...], int] = {}
            for end in range(1, len(tokens) + 1):
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    expected.setdefault(tuple(tokens[end - n : end]), end)
            assert self._first[key] == expected, f"sequence {key}: n-gram index is stale"
