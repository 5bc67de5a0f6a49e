"""The progress bar's arithmetic: the total it works toward and the ETA it shows, against the
same figures worked out by hand for a small job."""

from __future__ import annotations

import json
import time

import pytest

from batchpage.job.progress import JobProgress, TokenWork
from batchpage.job.progress_file import ProgressFile
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
    assert "replicas" not in progress.bar.postfix
    progress.replicas = lambda: "1/2 live, 1 lost"  # an executor's (ReplicaPool.replica_line)
    progress.step(stats, tok_s=3.0)
    assert "replicas=1/2 live, 1 lost" in progress.bar.postfix
    progress.close()


def test_the_bar_is_drawn_at_most_every_mininterval_with_set_postfixs_text() -> None:
    """A row or a step updates the bar's figures and text each time; drawing them is throttled
    to tqdm's mininterval (a stage change draws at once); the text is set_postfix's."""
    from tqdm import tqdm

    progress = JobProgress(rows_total=300, enabled=True)
    draws: list[tuple[float, str]] = []
    progress.bar.refresh = lambda *_, **__: draws.append((progress.bar.n, progress.bar.postfix))
    progress.bar.mininterval = 3600.0  # nothing is due again within this test
    progress.window_started([10] * 300)  # the first call draws
    stats = RunStats(kv_blocks_total=8, block_size=4)
    for done in range(1, 301):
        stats.prefill_tokens_computed = 10 * done
        progress.step(stats, tok_s=2.5)
        progress.row_finished(unused_budget=0)
        assert progress.bar.n == 10 * done and progress.rows_done == done
    assert len(draws) == 1
    progress.stage("finishing")
    assert len(draws) == 2 and draws[-1][0] == 3000
    reference = tqdm(total=0, disable=True)  # what set_postfix makes of the same fields
    reference.set_postfix({"rows": "300/300", "stage": "finishing"}, refresh=False)
    assert progress.bar.postfix == reference.postfix
    progress.step(stats, tok_s=2.5)
    reference.set_postfix({"rows": "300/300", "stage": "prefill", "out_tok_s": "2.5"})
    assert progress.bar.postfix == reference.postfix
    progress.bar.mininterval = 0.0  # due at every call: each one draws
    progress.row_finished(unused_budget=0)
    progress.row_finished(unused_budget=0)
    assert len(draws) == 4
    progress.close()


def test_progress_file_gives_the_bars_figures_and_is_rewritten_at_most_every_interval(
    tmp_path, monkeypatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    progress = JobProgress(rows_total=4, enabled=False)
    progress.rows_skipped(1, failed=True)  # a bad row: failed before generating
    progress.window_started([40, 40, 40])
    stats = RunStats(kv_blocks_total=8, block_size=4)
    stats.prefill_tokens_computed, stats.generated_tokens = 30, 10
    clock[0] += 4.0
    progress.step(stats, tok_s=2.5)
    progress.row_finished(unused_budget=0, failed=True)  # an engine error
    progress.row_finished(unused_budget=20)
    figures = {"replicas": [{"replica": 0, "rows": 2}], "replicas_lost": 0}
    status = ProgressFile(tmp_path, progress, executor=lambda: figures, every_s=10.0)
    status.write(wait=True)
    record = json.loads((tmp_path / "progress.json").read_text())
    assert record["rows_total"] == 4 and record["rows_done"] == 3 and record["rows_failed"] == 2
    assert record["stage"] == "generating" and record["out_tok_s"] == 2.5
    # 40 of 100 tokens in 4 s: 60 left at 10 tokens/s.
    assert record["elapsed_s"] == 4.0 and record["eta_s"] == 6.0
    assert record["executor"] == figures
    progress.row_finished(unused_budget=0)
    clock[0] += 9.0
    status.maybe_write()  # inside the interval: the file keeps the last state
    status.settle()
    assert json.loads((tmp_path / "progress.json").read_text())["rows_done"] == 3
    clock[0] += 1.0
    status.maybe_write()
    status.settle()
    assert json.loads((tmp_path / "progress.json").read_text())["rows_done"] == 4
    status.write(stage="done", wait=True)
    status.close()
    assert json.loads((tmp_path / "progress.json").read_text())["stage"] == "done"
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]  # no temporary left
    progress.close()
