"""The progress bar's arithmetic: the total it works toward and the ETA it shows, against the
same figures worked out by hand for a small job."""

from __future__ import annotations

import pytest

from batchpage.job.progress import JobProgress, TokenWork
from batchpage.metrics import RunStats


def test_total_prices_unread_rows_at_the_average_of_the_read_ones() -> None:
    work = TokenWork(rows_total=10)
    work.add_rows([100, 300])  # two rows read: prompt tokens plus output budget each
    assert work.total == 400 + 8 * 200
    work.add_rows([200] * 8)
    assert work.total == 2000


def test_an_early_stop_releases_its_unused_budget_and_shortens_the_eta() -> None:
    work = TokenWork(rows_total=2)
    work.add_rows([110, 110])  # 10 prompt tokens + 100 output tokens each
    work.advance(20 + 10)  # both prompts computed, 10 tokens generated in all
    assert work.eta_s(rate=10.0) == pytest.approx((220 - 30) / 10)
    work.release(95)  # one row hit EOS after 5 tokens
    assert work.total == 125 and work.eta_s(rate=10.0) == pytest.approx((125 - 30) / 10)
    assert work.eta_s(rate=0.0) is None


def test_done_never_exceeds_the_total() -> None:
    work = TokenWork(rows_total=1)
    work.add_rows([10])
    work.advance(25)  # recomputed prefill after a preemption counts again
    assert work.total == 25


def test_the_bar_moves_on_every_step_before_any_row_finishes() -> None:
    progress = JobProgress(rows_total=3, enabled=False)
    progress.rows_skipped(1)  # a resumed row costs nothing
    progress.window_started([50, 50])
    stats = RunStats(kv_blocks_total=8, block_size=4)
    stats.prefill_tokens_computed, stats.cached_prompt_tokens = 12, 8
    progress.step(stats, tok_s=0.0)
    assert (progress.bar.n, progress.bar.total) == (20, 100)
    stats.generated_tokens = 6
    progress.step(stats, tok_s=3.0)
    assert progress.bar.n == 26 and progress.rows_done == 1
    progress.row_finished(unused_budget=30)
    assert (progress.bar.total, progress.rows_done) == (70, 2)
    progress.close()
