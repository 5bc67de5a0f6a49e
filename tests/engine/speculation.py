"""Test doubles for speculative decoding: a drafter that knows the answers, and a step cost
model fixed where every draft pays (so tests speculate on any machine, however busy)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np


class WeightBound:
    """A step cost model fixed where every draft pays (a step that reads weights, each token
    nearly free), so these tests speculate on any machine, however busy; the measured one
    (speculative/budget.py) is tested against brute force in tests/speculative."""

    ready = True

    def observe(self, tokens: int, sampled: int, seconds: float) -> None:
        pass

    def coefficients(self) -> tuple[float, float]:
        return 1.0, 0.0  # a token costs nothing: any draft with odds above zero pays


class Oracle:
    """A drafter that knows each sequence's continuation (from a run without speculation) and
    proposes it, replacing each draft with a wrong token (in [3, 200)) with probability `wrong`:
    right, wrong and partly right drafts (wrong=1: every draft rejected), all in the engine's
    Drafter contract (batchpage/speculative/drafter.py)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong: float, seed: int):
        self.answers, self.wrong, self.rng = answers, wrong, random.Random(seed)
        self.tokens: dict[int, list[int]] = {}

    def start(
        self, key: int, prompt_token_ids: Sequence[int], prompt_len: int | None = None
    ) -> None:
        self.tokens[key] = list(prompt_token_ids)

    def append(self, key: int, tokens: Sequence[int]) -> None:
        self.tokens[key] += [int(t) for t in tokens]

    def append_many(self, keys: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        for key, row, n in zip(keys.tolist(), tokens.tolist(), counts.tolist(), strict=True):
            self.append(key, row[:n])

    def propose(self, key: int, k: int) -> np.ndarray:
        toks = self.tokens[key]
        # The longest prompt the tokens begin with whose answer they follow so far.
        fits = [
            p for p, a in self.answers.items()
            if tuple(toks[: len(p)]) == p and toks[len(p) :] == a[: len(toks) - len(p)]
        ]  # fmt: skip
        if not fits:
            return np.zeros(0, dtype=np.int64)
        prompt = max(fits, key=len)
        done = len(toks) - len(prompt)
        draft = list(self.answers[prompt][done : done + k])
        for i in range(len(draft)):
            if self.rng.random() < self.wrong:  # another of the 197 tokens in [3, 200)
                draft[i] = (draft[i] - 3 + self.rng.randrange(1, 197)) % 197 + 3
        return np.array(draft, dtype=np.int64)

    def propose_many(self, keys: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pairs = zip(np.asarray(keys).tolist(), k.tolist(), strict=True)
        drafts = [self.propose(key, int(n)) for key, n in pairs]
        out = np.zeros((len(keys), max(int(k.max()), 1)), dtype=np.int64)
        for i, d in enumerate(drafts):
            out[i, : len(d)] = d
        return out, np.array([len(d) for d in drafts], dtype=np.int64)

    def finish(self, key: int, token_ids: Sequence[int] | None = None) -> None:
        del self.tokens[key]

    def drop(self, key: int) -> None:
        del self.tokens[key]

    def learn(self, output_token_ids: Sequence[int]) -> None:
        pass  # it knows every answer already

    def check_integrity(self) -> None:
        pass
