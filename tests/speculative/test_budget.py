"""The draft budget against brute force: the drafts it picks give the best expected tokens per
second of any choice (every prefix-closed choice of drafts per row, enumerated), and the step
cost fit recovers a known line."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchpage.speculative.budget import StepCostFit, draft_counts


def _rate(alpha: np.ndarray, k: tuple[int, ...], rows: int, a: float, b: float) -> float:
    gained = sum(float(alpha[i]) ** j for i, n in enumerate(k) for j in range(1, n + 1))
    return (rows + gained) / (a + b * (rows + sum(k)))


def test_the_chosen_drafts_maximise_expected_tokens_per_second() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 4))
        alpha = rng.random(n)
        k_max = rng.integers(0, 4, size=n)
        rows = int(rng.integers(1, 64))
        a, b = float(rng.random() * 0.05), float(rng.random() * 0.002 + 1e-5)
        got = draft_counts(alpha, k_max, rows, a, b)
        assert ((got >= 0) & (got <= k_max)).all()
        best = max(
            _rate(alpha, k, rows, a, b)
            for k in itertools.product(*(range(int(m) + 1) for m in k_max))
        )
        assert _rate(alpha, tuple(got.tolist()), rows, a, b) >= best * (1 - 1e-9)


def test_compute_bound_steps_draft_nothing_and_weight_bound_ones_draft() -> None:
    alpha, cap = np.full(256, 0.7), np.full(256, 4)
    # A large batch where each token costs as much as the step's fixed part per 10 tokens.
    assert draft_counts(alpha, cap, 256, a=0.01, b=0.001).sum() == 0
    # One row, a step that reads weights (a) and computes little per token (b).
    assert draft_counts(alpha[:1], cap[:1], 1, a=0.01, b=0.0001).tolist() == [4]


def test_the_step_cost_fit_recovers_its_terms() -> None:
    """Prefill steps (many tokens, one sampled position a prompt), decode steps and steps
    with drafts (every token sampled): the fit recovers a, b and c, and a draft's cost b + c."""
    fit = StepCostFit(forget=1.0)
    assert not fit.ready
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows = int(rng.integers(1, 64))
        kind = int(rng.integers(3))
        tokens = rows * (int(rng.integers(16, 128)) if kind == 0 else 1 + 4 * (kind == 2))
        sampled = rows if kind == 0 else tokens
        fit.observe(tokens, sampled, 0.02 + 3e-5 * tokens + 2e-5 * sampled)
    assert fit.ready
    a, b, c = fit.terms()
    assert abs(a - 0.02) < 1e-6 and abs(b - 3e-5) < 1e-8 and abs(c - 2e-5) < 1e-8
    assert fit.coefficients()[1] == pytest.approx(5e-5, rel=1e-4)


def test_decode_steps_alone_still_give_a_drafts_cost() -> None:
    """Only decodes (tokens = sampled positions): b and c cannot come apart, their sum does."""
    fit = StepCostFit(forget=1.0)
    for rows in np.random.default_rng(2).integers(1, 256, size=100).tolist():
        fit.observe(rows, rows, 0.01 + 4e-5 * rows)
    a, d = fit.coefficients()
    assert a == pytest.approx(0.01, rel=1e-3) and d == pytest.approx(4e-5, rel=1e-3)
