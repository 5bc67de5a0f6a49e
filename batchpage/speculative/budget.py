"""Which drafts pay for themselves this step: a cost model of the step, and each row's odds.

A step's wall time grows with the tokens it runs and with the positions it samples:
t = a + b * T + c * S, fitted online over the engine's own steps (least squares with
forgetting, so it follows the machine as it warms up or gets busy). A prompt token costs b (its
layers; a prompt's rows are sampled only at its end), a decode row or a draft costs b + c (the
lm_head over the vocabulary, the sampler and the verification are per sampled position): a fit
on tokens alone read a draft as cheap as a prompt token, and drafted where it did not pay.
Prefill, decode and speculative steps run different mixes, which is what separates a (weights
read, per-step work), b and c; where they do not (only decodes, so T = S), a small ridge keeps
b + c, the figure drafting needs, exact. A row's next draft j is accepted with probability
p = alpha ** j (every draft before it must be accepted too), alpha its running acceptance.
Without drafts a step yields N tokens in a + d * N seconds (d = b + c); each draft adds d
seconds and p expected tokens. Drafts are taken best first while they raise the step's
expected tokens per second: p > d * (tokens / seconds so far). Where a step is bound by reading
weights (small batches, a GPU), d is small beside a and drafts pay at modest odds; where it is
bound by compute (large batches on a CPU), d * rate nears 1 and nothing drafts. The rule is
monotone: once a draft fails it, every later (lower-odds) one does too.
"""

from __future__ import annotations

import numpy as np

# The ridge on b and c, relative to the data's own scale: enough to settle a collinear fit
# (decode-only steps), far below what a fit with both kinds of steps measures.
_RIDGE = 1e-9


class StepCostFit:
    """Online least squares of step seconds against [1, tokens, sampled positions], with
    exponential forgetting."""

    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        self._xx = np.zeros((3, 3), dtype=np.float64)  # decayed sum of x x^T, x = [1, T, S]
        self._xy = np.zeros(3, dtype=np.float64)  # decayed sum of x * t

    def observe(self, tokens: int, sampled: int, seconds: float) -> None:
        """A step that ran `tokens` tokens and sampled `sampled` positions in `seconds`."""
        x = np.array([1.0, tokens, sampled])
        self._xx *= self.forget
        self._xy *= self.forget
        self._xx += np.outer(x, x)
        self._xy += x * seconds

    @property
    def ready(self) -> bool:
        """Whether the steps seen span enough token counts to tell a from the rest."""
        w = self._xx[0, 0]
        if w <= 0:
            return False
        mean = self._xx[0, 1] / w
        return self._xx[1, 1] / w - mean * mean > 1.0

    def coefficients(self) -> tuple[float, float]:
        """(a, d): seconds per step, seconds per sampled token (a decode row or a draft:
        d = b + c), d > 0 and a >= 0."""
        a, b, c = self.terms()
        return a, b + c

    def terms(self) -> tuple[float, float, float]:
        """(a, b, c) of t = a + b * T + c * S, each >= 0 (b + c > 0)."""
        xx = self._xx / self._xx[0, 0]
        xy = self._xy / self._xx[0, 0]
        scale = max(xx[1, 1], xx[2, 2], 1.0)
        ridge = np.diag([0.0, _RIDGE * scale, _RIDGE * scale])
        a, b, c = np.linalg.solve(xx + ridge, xy)
        if c < 0:  # refit without the sampled term (a machine's noise, not a cost)
            b = max((xy[1] - xx[0, 1] * xy[0]) / max(xx[1, 1] - xx[0, 1] ** 2, 1e-12), 1e-9)
            c = 0.0
        b = max(float(b), 0.0)
        if b + c <= 0:
            b = 1e-9
        a = max(float(xy[0] - b * xx[0, 1] - c * xx[0, 2]), 0.0)
        return a, b, float(c)


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
