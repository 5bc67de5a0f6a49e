"""Which drafts pay for themselves this step: a cost model of the step, and each row's odds.

A step's wall time grows with the tokens it runs: t(T) = a + b * T, fitted online over the
engine's own steps (least squares with forgetting, so it follows the machine as it warms up or
gets busy). Prefill, decode and speculative steps run different token counts, which is what
separates a (weights read, per-step work) from b (each token's compute). A row's next draft j is
accepted with probability p = alpha ** j (every draft before it must be accepted too), alpha its
running acceptance. Without drafts a step yields N tokens in a + b * N seconds; each draft adds
b seconds and p expected tokens. Drafts are taken best first while they raise the step's
expected tokens per second: p > b * (tokens / seconds so far). Where a step is bound by reading
weights (small batches, a GPU), b is small beside a and drafts pay at modest odds; where it is
bound by compute (large batches on a CPU), b * rate nears 1 and nothing drafts. The rule is
monotone: once a draft fails it, every later (lower-odds) one does too.
"""

from __future__ import annotations

import numpy as np


class StepCostFit:
    """Online least squares of step seconds against step tokens, with exponential forgetting."""

    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        # Decayed sums: weight, T, T^2, t, T*t.
        self._s = np.zeros(5, dtype=np.float64)

    def observe(self, tokens: int, seconds: float) -> None:
        self._s *= self.forget
        self._s += (1.0, tokens, tokens * tokens, seconds, tokens * seconds)

    @property
    def ready(self) -> bool:
        """Whether the steps seen span enough token counts to tell a from b."""
        w, st, stt, _, _ = self._s
        return w > 0 and (stt / w - (st / w) ** 2) > 1.0

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step, seconds per token (b > 0, a >= 0)."""
        w, st, stt, sy, sty = self._s
        var = stt / w - (st / w) ** 2
        b = (sty / w - (st / w) * (sy / w)) / var
        b = max(b, 1e-9)
        a = max(sy / w - b * st / w, 0.0)
        return a, b


def draft_counts(alpha: np.ndarray, k_max: np.ndarray, rows: int, a: float, b: float) -> np.ndarray:
    """int64 [len(alpha)]: how many drafts each candidate row should run next step. `alpha`:
    each row's acceptance odds (0..1), `k_max`: the most it may run, `rows`: the tokens the step
    runs without drafts, (a, b): the step's cost model. See the module docstring."""
    n = len(alpha)
    assert k_max.shape == (n,)
    width = int(k_max.max()) if n else 0
    if not width:
        return np.zeros(n, dtype=np.int64)
    j = np.arange(1, width + 1)
    odds = np.clip(alpha, 0.0, 1.0)[:, None] ** j  # [n, width]
    odds[j[None, :] > k_max[:, None]] = 0.0
    flat = odds.ravel()
    order = np.argsort(-flat, kind="stable")
    p = flat[order]
    gained = rows + np.cumsum(p) - p  # expected tokens before each candidate is added
    seconds = a + b * (rows + np.arange(len(p)))
    pays = p > b * gained / seconds
    taken = int(np.argmin(pays)) if not pays.all() else len(p)
    chosen = order[:taken]
    return np.bincount(chosen // width, minlength=n).astype(np.int64)
