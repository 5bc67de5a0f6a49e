"""RunStats: the figures of llm.stats and run.json, and their merge over a job's windows."""

from __future__ import annotations

from batchpage.metrics import RunStats, percentile


def window(requests: int, prompt: int, generated: int, cached: int, elapsed: float) -> RunStats:
    stats = RunStats(kv_blocks_total=10, block_size=4, start=0.0, end=elapsed)
    stats.requests, stats.prompt_tokens, stats.generated_tokens = requests, prompt, generated
    stats.cached_prompt_tokens = cached
    return stats


def test_merged_adds_counts_and_recomputes_rates_over_generation_time() -> None:
    a, b = window(2, 10, 20, 5, 1.0), window(2, 10, 20, 0, 3.0)
    a.record_step(num_running=3, used_slots=4, reserved_slots=8, blocks_used=2)
    b.record_step(num_running=5, used_slots=8, reserved_slots=8, blocks_used=7)
    a.preemptions, b.swaps = 1, 2
    a.first_token_s, b.first_token_s = [0.1, 0.2], [0.3, 0.4]
    m = RunStats.merged([a, b]).as_dict()
    assert (m["requests"], m["generated_tokens"], m["steps"]) == (4, 40, 2)
    assert (m["preemptions"], m["swaps"]) == (1, 2)
    assert (m["peak_running"], m["peak_kv_blocks_used"]) == (5, 7)
    assert m["prefix_hit_rate"] == 0.25
    assert m["kv_utilization"] == 12 / 16
    assert m["elapsed_s"] == 4.0 and m["output_tokens_per_s"] == 10.0
    assert m["ttft_s"] == {"p50": 0.2, "p90": 0.4}
    # The merged dict has exactly the keys of one run's: run.json and llm.stats agree.
    assert m.keys() == a.as_dict().keys()


def test_merged_of_nothing_is_an_empty_run() -> None:
    m = RunStats.merged([]).as_dict()
    assert m["generated_tokens"] == 0 and m["output_tokens_per_s"] == 0.0
    # It took no time: a clock that ended at 0 is not a clock still running (the progress bar
    # once divided a window's tokens by the machine's uptime).
    assert m["elapsed_s"] == 0.0


def test_the_job_rate_of_a_first_window_is_its_own_rate() -> None:
    from batchpage.job.progress import job_rate

    run = RunStats(kv_blocks_total=8, block_size=4, start=10.0, end=14.0)
    run.generated_tokens = 40
    assert job_rate(RunStats.merged([]), run) == 10.0
    done = RunStats(kv_blocks_total=8, block_size=4, start=0.0, end=6.0)
    done.generated_tokens = 20
    assert job_rate(RunStats.merged([done]), run) == 6.0  # (20 + 40) / (6 + 4)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == 4.0
