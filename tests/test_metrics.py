"""RunStats: the figures of llm.stats and run.json, and their merge over a job's windows."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from batchpage.metrics import SAMPLES_BLOCK, STEP_PARTS, RunStats, Samples, percentile


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


def nearest_rank(values: list[float], q: float) -> float:
    """The reference: sort a list, take the nearest rank."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


@pytest.mark.parametrize("seed", range(20))
def test_samples_hold_what_a_list_holds(seed: int) -> None:
    """Appended one by one, extended by lists and by other Samples (whose blocks are shared):
    the same values in the same order as a list, and the same percentiles."""
    rng = random.Random(seed)
    samples, reference = Samples(), []
    others = []
    for _ in range(rng.randint(1, 12)):
        how = rng.random()
        if how < 0.4:
            for _ in range(rng.choice([1, 7, SAMPLES_BLOCK + 3])):
                value = rng.random() * 10
                samples.append(value)
                reference.append(value)
        elif how < 0.65:
            values = [rng.random() for _ in range(rng.choice([0, 5, 2 * SAMPLES_BLOCK]))]
            samples.extend(values)
            reference += values
        elif how < 0.7 and len(samples) < 4 * SAMPLES_BLOCK:
            samples.extend(samples)  # itself: what it held, twice
            reference += reference
        else:
            other = Samples(rng.random() for _ in range(rng.choice([0, 3, SAMPLES_BLOCK + 1])))
            samples.extend(other)
            reference += list(other)
            others.append((other, list(other)))
        samples.check_integrity()
        assert len(samples) == len(reference) and samples == reference
    assert list(samples) == reference and samples.array().tolist() == reference
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(samples, q) == nearest_rank(reference, q)
        assert percentile(reference, q) == nearest_rank(reference, q)
    for other, values in others:  # a Samples taken in stays as it was
        assert other == values


def run(rng: random.Random, block_size: int = 16) -> RunStats:
    stats = RunStats(kv_blocks_total=rng.randint(1, 99), block_size=block_size, start=1.0)
    stats.end = 1.0 + rng.random()
    for name in ("requests", "prompt_tokens", "generated_tokens", "preemptions", "steps"):
        setattr(stats, name, rng.randint(0, 50))
    stats.peak_running = rng.randint(0, 9)
    stats.first_token_s = rng.choice([list, Samples])(
        rng.random() for _ in range(rng.randint(0, 9))
    )
    stats.step_time_s = {p: rng.random() for p in STEP_PARTS}
    stats.weight_bytes = rng.randint(1, 10**6)
    return stats


@pytest.mark.parametrize("seed", range(10))
def test_absorbing_runs_one_by_one_is_merging_them_at_once(seed: int) -> None:
    """What a job does with its windows (absorb each as it ends) against the figures worked out
    by hand from all the runs."""
    rng = random.Random(seed)
    runs = [run(rng) for _ in range(rng.randint(0, 6))]
    total = RunStats.merged([])
    for r in runs:
        total.absorb(r)
        total.first_token_s.check_integrity()
    at_once = RunStats.merged(runs)
    pooled = [t for r in runs for t in r.first_token_s]
    for merged in (total, at_once):
        got = merged.as_dict()
        assert got["requests"] == sum(r.requests for r in runs)
        assert got["generated_tokens"] == sum(r.generated_tokens for r in runs)
        assert got["peak_running"] == max((r.peak_running for r in runs), default=0)
        assert got["kv_blocks_total"] == max((r.kv_blocks_total for r in runs), default=0)
        assert got["elapsed_s"] == sum(r.elapsed_s for r in runs)
        assert got["ttft_s"] == {"p50": nearest_rank(pooled, 50), "p90": nearest_rank(pooled, 90)}
        assert got["step_time_s"] == {p: sum(r.step_time_s[p] for r in runs) for p in STEP_PARTS}
        assert got["weight_bytes"] == (runs[-1].weight_bytes if runs else 0)
        assert merged.block_size == (16 if runs else 0)
        assert list(merged.first_token_s) == pooled
    assert total == at_once


def test_a_run_holds_eight_bytes_a_first_token() -> None:
    """A job pools a figure per row: float64 blocks, not a list of float objects, and merging
    its windows copies no block."""
    tracemalloc.start()
    try:
        total = RunStats.merged([])
        for _ in range(50):
            window = RunStats(kv_blocks_total=8, block_size=16)
            for _ in range(1000):
                window.record_first_token()
            window.finish()
            total.absorb(window)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(total.first_token_s) == 50_000
    assert held < 8 * 50_000 * 1.25
