"""Verification of drafted tokens: which of a row's drafts the target model accepts.

A row that ran its newest token and c - 1 drafted tokens in one forward has c logits rows; each is
sampled exactly as a step without speculation would sample that position (the same sampler,
settings and draw key: the row's seed and the token's position), giving c target tokens. The
drafts are accepted while each equals the target token drawn before it; the row then takes the
accepted drafts and the target token after them (one more than it accepted).

Why this keeps the target distribution exactly: a drafter proposes one token (its distribution
is a point mass), and for a point mass, rejection sampling's rule (accept with the target's
probability of the draft, else draw from the target with the draft removed) yields the target
distribution, as does drawing from the target and comparing. Drawing with the same key as
without speculation goes further: a seeded row takes the very tokens it takes without
speculation, bit for bit where the logits are (batch_invariant), since every position is drawn
from the same logits with the same key. Only a drafter with a distribution of its own (a draft
model) needs rejection sampling proper.
"""

from __future__ import annotations

import numpy as np


def accepted_counts(targets: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64 [N]: how many of each row's drafts are accepted. `targets` [N, K]: the target
    tokens of each row's `counts[i]` positions (then padding); `drafts` [N, K - 1]: its
    counts[i] - 1 drafted tokens (then padding). Draft j is accepted when drafts j' <= j all
    equal the targets drawn before them (targets[i, j'])."""
    n, k = targets.shape
    assert drafts.shape == (n, max(k - 1, 0)), f"drafts {drafts.shape} for targets {targets.shape}"
    assert counts.shape == (n,) and (counts >= 1).all() and (counts <= k).all()
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    match = drafts == targets[:, :-1]
    match &= np.arange(k - 1) < (counts - 1)[:, None]  # padding never matches
    return np.cumprod(match, axis=1).sum(axis=1).astype(np.int64)
