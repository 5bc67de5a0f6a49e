"""run.json's estimate of each run and progress.json's ETA from it (issue #73 item 3), on the tiny
model: why a job has no estimate, the estimate against the engine's own steps, windows scaled
past the simulation budget, the ETA's arithmetic on a clock of the test's, and (slow) a real
calibration's estimate and ETA against a measured run."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from batchpage import LLM
from batchpage.engine.config import EngineConfig
from batchpage.job import job_estimate as job_estimate_module
from batchpage.job import loop, run_job
from batchpage.job.config import JobConfig
from batchpage.job.dry_run import dry_run
from batchpage.job.job_estimate import PACE_PRIOR, JobEstimate, job_estimate
from batchpage.job.plan import plan_job
from batchpage.job.plan_options import PlanConfig
from batchpage.job.progress_file import ProgressFile
from batchpage.metrics import RunStats
from batchpage.sampling_params import SamplingParams
from batchpage.simulate.calibrate import calibration_key, this_device
from batchpage.simulate.capacity import Row
from batchpage.simulate.measured import CalibrationCache, MeasuredDevice
from batchpage.simulate.step_cost import Efficiency
from tests.job.test_dry_run_plan import WORDS, job

# A step costs its overhead alone: the model's FLOPs and bytes take no time at these peaks.
STEP_S = 2e-3
ONLY_OVERHEAD = Efficiency(1e12, 1e12, 1e12, 1e12, overhead_s=STEP_S)


def numbered_rows(path: Path, count: int) -> Path:
    """Prompts of 4 to 19 words after the row's number: no two share a full KV block, so every
    window's steps are the same with or without the windows before it in the cache."""
    lines = []
    for i in range(count):
        words = " ".join(WORDS[(i * 5 + j) % 16] for j in range(4 + i % 16))
        lines.append(json.dumps({"prompt": f"{i} {words}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def cache_calibration(cfg: JobConfig, eff: Efficiency, load_s: float = 0.25) -> MeasuredDevice:
    """A calibration of the job's setup in the cache, as `dry_run=true plan.devices=[this]`
    would leave one."""
    plan = plan_job(cfg)
    engine = EngineConfig(**asdict(cfg.engine))
    key = calibration_key(engine, plan.source, plan.engine.dtype, plan.engine.device)
    spec = this_device(plan.engine.device, plan.engine.dtype)
    found = MeasuredDevice(spec, eff, "a test's", load_s, per_request_s=1e-4, key=key)
    CalibrationCache(key).put(found)
    return found


def last_run(out: Path) -> dict[str, Any]:
    return json.loads((out / "run.json").read_text())["runs"][-1]


def test_a_job_without_a_calibration_says_why_it_has_no_estimate(
    tmp_path, tiny_folder, monkeypatch
) -> None:
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    data = numbered_rows(tmp_path / "d.jsonl", 12)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 5})
    run_job(cfg)
    run = last_run(tmp_path / "out")
    assert run["estimate"] is None and "plan.devices=[this]" in run["no_estimate"]
    parts = run["parts_s"]
    assert set(parts) == {"setup", "load", "io", "generate", "finish"}
    assert all(v >= 0 for v in parts.values()) and parts["load"] > 0
    assert sum(parts.values()) == pytest.approx(run["wall_s"])
    # The engine's own clock runs inside the generate calls that the job times.
    assert run["metrics"]["elapsed_s"] <= parts["generate"] <= run["wall_s"]
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert progress["eta_from"] == "rate"


def test_run_json_estimates_the_steps_the_engine_took(tmp_path, tiny_folder, monkeypatch) -> None:
    """Every window simulated: the estimate's steps (each STEP_S) are the engine's, its tokens
    and peak batch the engine's; its setup is the planning measured and the calibration's
    load; estimate_error is its wall time over the run's."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(job_estimate_module, "SIM_SHARE", math.inf)
    data = numbered_rows(tmp_path / "d.jsonl", 40)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 16},
              engine={"max_num_seqs": 8})  # fmt: skip
    cached = cache_calibration(cfg, ONLY_OVERHEAD)
    run_job(cfg)
    run = last_run(tmp_path / "out")
    estimate, metrics = run["estimate"], run["metrics"]
    assert estimate["windows"] == estimate["windows_simulated"] == 3
    parts = estimate["parts_s"]
    steps = (parts["prefill"] + parts["decode"] + parts["preemption"]) / STEP_S
    assert steps == pytest.approx(metrics["steps"])
    assert estimate["generated_tokens"] == metrics["generated_tokens"] == 40 * 16
    assert estimate["peak_running"] == metrics["peak_running"] == 8
    assert parts["setup"] == pytest.approx(run["parts_s"]["setup"] + cached.load_s)
    assert parts["io"] >= 40 * cached.per_request_s
    assert estimate["source"] == "a test's" and estimate["output_tokens"].startswith("max_tokens")
    assert run["estimate_error"] == pytest.approx(estimate["wall_s"] / run["wall_s"] - 1)
    progress = json.loads((tmp_path / "out" / "progress.json").read_text())
    assert progress["eta_from"] == "estimate"


@pytest.mark.parametrize("where", ["start", "window"])
def test_an_estimate_that_fails_never_stops_the_job(
    tmp_path, tiny_folder, monkeypatch, where: str
) -> None:
    """A bug in the estimate (at its start, or in a window's simulation): every row is still
    generated, and run.json says why there is no estimate."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    data = numbered_rows(tmp_path / "d.jsonl", 12)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 5})
    cache_calibration(cfg, ONLY_OVERHEAD)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    target = "plan_pool" if where == "start" else "schedule"
    monkeypatch.setattr(job_estimate_module, target, broken)
    result = run_job(cfg)
    run = last_run(tmp_path / "out")
    assert result.rows_generated == 12 and result.errors == 0
    assert run["estimate"] is None
    assert "the estimate failed (ZeroDivisionError: a bug)" in run["no_estimate"]


def test_windows_past_the_simulation_budget_are_scaled_from_the_simulated_ones(
    tmp_path, tiny_folder, monkeypatch
) -> None:
    """Only the first window simulated: the others' tokens follow their output budget (exact
    with ignore_eos) and their steps their token work, near what simulating them gives."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    data = numbered_rows(tmp_path / "d.jsonl", 64)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 16},
              engine={"max_num_seqs": 8})  # fmt: skip
    cache_calibration(cfg, ONLY_OVERHEAD)
    plan = plan_job(cfg)
    rows = [Row([[3 + (i * 7 + j) % 200 for j in range(4 + i % 40)]],
                SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(64)]  # fmt: skip
    found = {}
    for share in (0.0, math.inf):
        monkeypatch.setattr(job_estimate_module, "SIM_SHARE", share)
        estimate, _ = job_estimate(cfg, plan)
        assert estimate is not None
        for start in range(0, 64, 16):
            estimate.window(rows[start : start + 16])
            estimate.window_done()
        found[share] = estimate.report(0.0)
    scaled, simulated = found[0.0], found[math.inf]
    assert (scaled["windows_simulated"], simulated["windows_simulated"]) == (1, 4)
    assert scaled["generated_tokens"] == simulated["generated_tokens"] == 64 * 16
    assert scaled["parts_s"]["decode"] == pytest.approx(simulated["parts_s"]["decode"], rel=0.1)
    assert scaled["wall_s"] == pytest.approx(simulated["wall_s"], rel=0.1)


def test_the_eta_is_the_work_left_at_the_pace_measured(tmp_path, tiny_folder, monkeypatch) -> None:
    """On the test's clock: before anything ran the ETA is the estimate; windows that take
    twice their estimate make the rest take twice its own (the pace; the window running counted
    by its prefill part, prompt tokens computed, and the rest, tokens generated; before the
    first window is done, PACE_PRIOR of it counts as run at 1), plus the rows not read at the
    seconds a row so far outside the generate calls."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(job_estimate_module, "SIM_SHARE", math.inf)
    cfg = job(numbered_rows(tmp_path / "d.jsonl", 4), tiny_folder, tmp_path / "out")
    cal = cache_calibration(cfg, ONLY_OVERHEAD)
    now = [0.0]
    engine = EngineConfig(**asdict(cfg.engine))
    estimate = JobEstimate(engine, plan_job(cfg), cal, "max", 64, clock=lambda: now[0])
    rows = [Row([[3 + (i * 7 + j) % 200 for j in range(4 + i % 40)]],
                SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(16)]  # fmt: skip
    assert estimate.eta_s() is None
    estimate.rows_read(16)
    estimate.window(rows)
    first = estimate.windows[0]
    per_row = first.seconds / 16
    assert estimate.eta_s() == pytest.approx(first.seconds + 48 * per_row)  # nothing measured
    stats = RunStats(kv_blocks_total=1, block_size=16)
    stats.prefill_tokens_computed = first.prompt_tokens
    estimate.step(stats)
    now[0] = 3 * first.prefill_s  # the prefill part at 3x, against PACE_PRIOR at 1
    pace = (PACE_PRIOR * first.seconds + 3 * first.prefill_s) / (
        PACE_PRIOR * first.seconds + first.prefill_s
    )
    left = first.seconds - first.prefill_s + 48 * per_row
    assert estimate.eta_s() == pytest.approx(left * pace)
    now[0] = 2 * first.seconds
    estimate.window_done()
    estimate.outside(0.5)
    assert estimate.eta_s() == pytest.approx(48 * per_row * 2 + 48 * 0.5 / 16)
    estimate.rows_read(16)
    estimate.window(rows)  # the same rows: the same estimate
    stats = RunStats(kv_blocks_total=1, block_size=16)
    stats.prefill_tokens_computed = first.prompt_tokens  # every prompt and half the outputs
    stats.generated_tokens = round(first.generated_tokens) // 2
    estimate.step(stats)
    # The prefill part done, and half the rest (the tokens generated).
    done = first.prefill_s + (first.seconds - first.prefill_s) / 2
    now[0] += 2 * done
    left = first.seconds - done + 32 * per_row
    assert estimate.eta_s() == pytest.approx(left * 2 + 32 * 0.5 / 16)


def test_rows_an_earlier_run_did_cost_the_eta_nothing(tmp_path, tiny_folder, monkeypatch) -> None:
    """A resumed job: of 64 rows, 32 done before; the first window's 16 all resumed (no ETA
    yet: nothing to generate read), the second's to generate: the ETA counts the 16 rows left
    to generate among the 32 not read."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    cfg = job(numbered_rows(tmp_path / "d.jsonl", 4), tiny_folder, tmp_path / "out")
    cal = cache_calibration(cfg, ONLY_OVERHEAD)
    engine = EngineConfig(**asdict(cfg.engine))
    estimate = JobEstimate(engine, plan_job(cfg), cal, "max", 64, 32, clock=lambda: 0.0)
    estimate.rows_read(16, resumed=16)
    assert estimate.eta_s() is None
    rows = [Row([[3 + (i * 7 + j) % 200 for j in range(4 + i % 40)]],
                SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(16)]  # fmt: skip
    estimate.rows_read(16)
    estimate.window(rows)
    (first,) = estimate.windows
    assert estimate.eta_s() == pytest.approx(first.seconds + 16 * first.seconds / 16)


class PaddedSteps:
    """An LLM factory whose engine steps take at least STEP_BASE_S plus STEP_TOKEN_S a token
    computed (each padded by a sleep): a device slower than the calibration says, of another
    shape (its prompt tokens cost more than its steps), whose steps the machine's own load
    barely moves."""

    def __call__(self, model: str, **engine: Any) -> LLM:
        llm = LLM(model, **engine)
        step = llm.engine.step

        def padded() -> Any:
            stats = llm.engine.stats
            before = stats.prefill_tokens_computed + stats.generated_tokens
            start = time.perf_counter()
            out = step()
            tokens = stats.prefill_tokens_computed + stats.generated_tokens - before
            left = STEP_BASE_S + STEP_TOKEN_S * tokens - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
            return out

        llm.engine.step = padded  # type: ignore[method-assign]
        return llm


STEP_BASE_S, STEP_TOKEN_S = 8e-3, 2e-5


def progress_seen(monkeypatch) -> list[tuple[float, dict[str, Any]]]:
    """Every progress.json record the job writes, with its time, as the job writes it (every
    0.1 s while rows finish and steps run)."""
    monkeypatch.setattr(loop, "PROGRESS_EVERY_S", 0.1)
    seen: list[tuple[float, dict[str, Any]]] = []
    write = ProgressFile.write

    def recording(self: ProgressFile, stage: str | None = None, wait: bool = False) -> None:
        seen.append((time.perf_counter(), self.progress.snapshot()))
        write(self, stage, wait)

    monkeypatch.setattr(ProgressFile, "write", recording)
    return seen


def eta_errors(seen: list[tuple[float, dict[str, Any]]], ended: float) -> list[float]:
    """Each record's ETA against the seconds the job then took, less 1, from the first with a
    tenth of the rows done to the last with half: the goal's span, past the windows' sawtooth
    (a window's last rows are saved after its last step) and a busy machine's single stalls."""
    return [
        s["eta_s"] / (ended - t) - 1
        for t, s in seen
        if 0.1 <= s["rows_done"] / s["rows_total"] <= 0.5 and s["eta_from"] == "estimate"
    ]


def test_the_eta_once_a_tenth_is_done_is_within_15_percent(
    tmp_path, tiny_folder, monkeypatch
) -> None:
    """Issue #73's goal on a device whose steps take about five times what the calibration
    says, prompt tokens dearer: once a tenth of the rows are done, the ETA is within 15% of
    the time the job then took (the median of progress.json's records up to half the rows)."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    seen = progress_seen(monkeypatch)
    data = numbered_rows(tmp_path / "d.jsonl", 4096)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 128})
    cache_calibration(cfg, Efficiency(1e12, 1e12, 1e12, 1e12, overhead_s=STEP_BASE_S / 3))
    run_job(cfg, PaddedSteps())
    errors = eta_errors(seen, time.perf_counter())
    assert len(errors) >= 10 and abs(statistics.median(errors)) <= 0.15, errors


@pytest.mark.slow  # a calibration (several seconds of steps) and a job of a few thousand rows
def test_a_calibrated_jobs_estimate_and_eta_against_its_run(
    tmp_path, tiny_folder, monkeypatch
) -> None:
    """The dry run calibrates this machine (into an empty cache); the job then carries that
    estimate in run.json within 20% of its wall time (issue #73's goal), and progress.json's
    ETA, once a tenth of the rows are done, follows the time the job then took. The
    linears are forced (torch), as in test_dry_run_plan's measured test."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    data = numbered_rows(tmp_path / "d.jsonl", 6144)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 256},
              engine={"linear_backend": "torch", "kv_cache_memory": 2**24})  # fmt: skip
    cfg.plan = PlanConfig(devices=["this"])
    here = dry_run(cfg)["this_machine"]
    assert here["source"].startswith("calibrated")
    seen = progress_seen(monkeypatch)
    run_job(cfg)
    errors = eta_errors(seen, time.perf_counter())
    run = last_run(tmp_path / "out")
    assert run["estimate"]["source"] == here["source"]
    measured = {k: round(v, 2) for k, v in run["parts_s"].items()}
    # Looser than the goals (20%, 15%): a tiny model's windows take a fraction of a second,
    # which other work on a shared machine stretches at random; the goals are checked on steps
    # of known length above, and measured on a quiet machine by jobs/bench/estimate.py. Here:
    # the estimate and the ETA follow the run, not a figure off by a factor.
    assert abs(run["estimate_error"]) <= 0.5, (run["estimate"], measured)
    assert len(errors) >= 10 and abs(statistics.median(errors)) <= 0.5, errors
