"""The Drafter contract: what the engine calls to get draft tokens for speculative decoding.

A drafter proposes tokens from what a sequence and the job have already produced (no weights).
The engine keys sequences by an int (its seq_id) and calls, per sequence:

    start(key, tokens, prompt_len)
                         once when the engine begins to follow it (at its first draft, which
                         may come after its first tokens), and again when it restarts after a
                         preemption: `tokens` is every token it has so far, the first
                         `prompt_len` of them its prompt (None: all of them); start replaces
                         any state the key had
    append(key, tokens)  each step, the tokens it accepted (1..k+1 of them), in order
    propose(key, k)      0..k tokens that may continue its tokens (int64); never more than k
    finish(key, tokens)  when it ends, with all its tokens (None: those given so far; the
                         engine gives them, since the step that ends a sequence appends nothing
                         to it); its state is freed (a drafter that learns across sequences
                         keeps what it learned from it)
    drop(key)            when the engine lets go of it before it ends (a run abandoned, rows
                         no longer drafted for); its state is freed and nothing is learned
    learn(output)        the output of a sequence that ended without being followed (drafts
                         did not pay while it ran): a drafter that learns across sequences
                         learns from it as from a finished one; others ignore it

The engine makes the per-step calls over arrays of keys: `append_many(keys, tokens, counts)`
after a step for the rows that took tokens, and `propose_many(keys, k)` for the rows it drafts
for (a columnar drafter then runs the same Python at any batch size; ngram.py is one, a drafter
with per-key structures loops, drafter.py's helpers). A key not started (or already finished) is
a KeyError in append, propose, finish and drop. Drafts are a pure function of the calls made so far:
the same calls give the same drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np


class Drafter(Protocol):
    def start(
        self, key: int, prompt_token_ids: Sequence[int], prompt_len: int | None = None
    ) -> None: ...

    def append(self, key: int, tokens: Sequence[int]) -> None: ...

    def append_many(self, keys: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """append for many distinct keys at once: keys[i] takes tokens[i, : counts[i]] (int64
        [len(keys), K]; what follows in a row is ignored)."""
        ...

    def propose(self, key: int, k: int) -> np.ndarray: ...

    def propose_many(
        self, keys: Sequence[int] | np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for many keys at once: ([len(keys), max(k)] int64 drafts, [len(keys)] int64
        counts). Row i holds counts[i] <= k[i] tokens, then zeros."""
        ...

    def finish(self, key: int, token_ids: Sequence[int] | None = None) -> None: ...

    def drop(self, key: int) -> None: ...

    def learn(self, output_token_ids: Sequence[int]) -> None: ...

    def check_integrity(self) -> None: ...


def drafts_array(
    draft: Callable[[int, int], list[int]], keys: Sequence[int] | np.ndarray, k: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """propose_many from a per-key `draft(key, k) -> list of tokens` (a drafter with per-key
    structures, suffix.py): the drafts padded with zeros into one array, and their counts."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1).tolist()
    ks = np.asarray(k, dtype=np.int64).reshape(-1)
    if len(ks) != len(keys):
        raise ValueError(f"propose_many: {len(keys)} keys but {len(ks)} values of k")
    width = int(ks.max()) if len(ks) else 0
    out = np.zeros((len(keys), max(width, 0)), dtype=np.int64)
    counts = np.zeros(len(keys), dtype=np.int64)
    for i, (key, n) in enumerate(zip(keys, ks.tolist(), strict=True)):
        tokens = draft(key, n)
        if tokens:
            out[i, : len(tokens)] = tokens
            counts[i] = len(tokens)
    return out, counts


def append_each(
    append: Callable[[int, list[int]], None],
    keys: np.ndarray,
    tokens: np.ndarray,
    counts: np.ndarray,
) -> None:
    """append_many from a per-key `append(key, tokens)` (a drafter with per-key structures)."""
    rows = np.asarray(tokens, dtype=np.int64).tolist()
    for key, row, n in zip(
        np.asarray(keys).tolist(), rows, np.asarray(counts).tolist(), strict=True
    ):
        append(key, row[:n])


def token_list(tokens: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (numpy arrays and scalars included)."""
    return np.asarray(tokens, dtype=np.int64).reshape(-1).tolist()
