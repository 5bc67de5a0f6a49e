"""The capacity plan's pieces against what they model: windows simulated on one scheduler
against one engine's generate calls, the fit against step times a known Efficiency makes, the
window sample's uniformity, and measured devices through their files and the cache."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.engine.config import EngineConfig
from batchpage.sampling_params import SamplingParams as Params
from batchpage.simulate.calibrate import calibration_runs, full_batch_run, long_context_run
from batchpage.simulate.capacity import Row, WindowSample
from batchpage.simulate.devices import GPUS, DeviceSpec, parse_device
from batchpage.simulate.fit import FIT_NAMES, FitGroup, fit_efficiency
from batchpage.simulate.measured import CalibrationCache, MeasuredDevice, load_device
from batchpage.simulate.simulator import simulate_windows
from batchpage.simulate.step_cost import Efficiency, StepCost
from tests.simulate.test_simulator import ENGINE, cost_of, requests


def test_windows_are_the_engines_generate_calls(tiny_folder: Path) -> None:
    """Three generate calls on one engine (the radix cache and the admission's growth estimate
    kept between them), a pool tight enough to preempt: the windows simulated on one scheduler
    take the same steps, hit the same cached tokens and preempt as often."""
    windows = [requests(30, seed=s) for s in (3, 4, 5)]
    engine = {"kv_cache_memory": 32 * 8 * 2 * 2 * 2 * 32 * 4, "max_num_seqs": 16}  # 32 blocks
    llm = LLM(str(tiny_folder), **ENGINE, **engine)
    steps = cached = preemptions = generated = 0
    for window in windows:
        params = [Params(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in window]
        llm.generate([r.prompt_token_ids for r in window], params, use_tqdm=False)
        stats = llm.run_stats
        steps += stats.steps
        cached += stats.cached_prompt_tokens
        preemptions += stats.preemptions
        generated += stats.generated_tokens
    cfg = EngineConfig(**{**ENGINE, **engine})
    got = simulate_windows(
        windows, cfg, llm.plan.num_blocks, llm.plan.max_model_len, cost_of(tiny_folder),
        cfg.batched_tokens(torch.device("cpu")),
    )  # fmt: skip
    assert (got.steps, got.cached_prompt_tokens) == (steps, cached)
    assert (got.preemptions, got.generated_tokens) == (preemptions, generated)
    assert got.preemptions > 0 and got.cached_prompt_tokens > 0  # both are exercised
    parts = got.prefill_seconds + got.decode_seconds + got.recompute_seconds + got.swap_seconds
    assert parts == pytest.approx(got.seconds, rel=1e-9)
    assert got.recompute_seconds > 0 and got.prefill_seconds > 0 and got.decode_seconds > 0


def test_the_fit_finds_the_efficiency_that_timed_the_steps(tiny_folder: Path) -> None:
    """Groups of simulated steps timed by StepCost under a known Efficiency (each step one by
    one, not through the fit's arrays): the fit, started elsewhere, gives those times back."""
    cost = cost_of(tiny_folder)
    truth = Efficiency(compute=0.2, attention=0.05, decode_attention=0.4, memory=0.3,
                       overhead_s=2e-4, per_seq_s=3e-6, per_prefill_s=5e-5)  # fmt: skip
    timed = StepCost(cost.shape, cost.device, truth)
    cfg = EngineConfig(**ENGINE, kv_cache_memory=2**21)
    groups = []
    for seed in range(6):
        sim = simulate_windows([requests(10 * (seed + 1), seed)], cfg, 512, 256, cost, 64, True)
        for prefill in (True, False):
            works = [w for w in sim.works if (w.tokens > w.seqs) == prefill]
            groups.append(FitGroup(works, sum(timed.seconds(w) for w in works)))
    start = Efficiency(overhead_s=1e-3, per_seq_s=1e-5, per_prefill_s=1e-4)
    fitted = StepCost(cost.shape, cost.device, fit_efficiency(groups, cost, starts=[start]))
    for group in groups:
        modelled = sum(fitted.seconds(w) for w in group.works)
        assert modelled == pytest.approx(group.measured_s, rel=0.02)


def test_the_window_sample_keeps_whole_windows_uniformly() -> None:
    """Reservoir sampling: each of 20 windows kept about equally often over many seeds, whole
    and in the job's order; the scale is rows to generate over rows kept."""
    params = SamplingParams(max_tokens=4)
    jobs = [[Row([[w, i]], params) for i in range(3 + w % 2)] for w in range(20)]
    kept: Counter[int] = Counter()
    for seed in range(2000):
        sample = WindowSample(max_rows=8, window_rows=4, seed=seed)
        for window in jobs:
            sample.add(window)
        firsts = [w[0].prompts[0][0] for w in sample.windows]
        assert firsts == sorted(firsts) and len(firsts) == 2
        assert all(w in jobs for w in sample.windows)
        assert sample.scale == pytest.approx(70 / sum(len(w) for w in sample.windows))
        kept.update(firsts)
    assert set(kept) == set(range(20))
    assert max(kept.values()) / min(kept.values()) < 1.4  # 200 expected each


def test_a_measured_device_is_a_file_and_a_cache_entry(tmp_path: Path) -> None:
    spec = DeviceSpec("gpu-x", 1e14, 1e12, 24e9, overlap=True)
    measured = MeasuredDevice(spec, Efficiency(compute=0.4), "calibrated here", 1.5, 123,
                              2e-5, [{"run": "a", "measured_s": 1.0}], {"k": "v"})  # fmt: skip
    path = tmp_path / "gpu-x.json"
    path.write_text(measured.to_json())
    assert load_device(path) == measured
    assert json.loads(path.read_text())["spec"]["flops"] == 1e14  # plain JSON, readable as such
    cache = CalibrationCache({"k": "v"}, tmp_path / "cache")
    assert cache.get() is None
    cache.put(measured)
    assert cache.get() == measured
    assert CalibrationCache({"k": "w"}, tmp_path / "cache").get() is None  # another setup
    with pytest.raises(ValueError, match="device file"):
        load_device(tmp_path / "nope.json")
    assert parse_device(str(path)).name == str(path)


def test_device_names() -> None:
    assert parse_device("h100:tp8") == ("h100", 8) and parse_device("l4").tp == 1
    assert parse_device("this").label == "this" and parse_device("l4:tp2").label == "l4:tp2"
    for bad in ("h100:tp0", "h100:tp", "tpu", "h100:tpx"):
        with pytest.raises(ValueError):
            parse_device(bad)
    assert set(GPUS) == {"h100", "a100-80gb", "h200", "l4"}
    assert tuple(f for f in Efficiency.__dataclass_fields__) == FIT_NAMES


@pytest.mark.parametrize("max_model_len", [64, 256, 4096])
def test_the_calibration_runs_fit_the_model_length_and_keep_a_shared_prefix(
    max_model_len: int,
) -> None:
    """Every run the calibration times fits max_model_len, and a shared-prefix run is among
    them wherever a block can be shared: without one the fit cannot tell a shared prefix's
    attention (computed for every row) from its K/V reads (once a step), and a job of shared
    prompts is estimated too fast."""
    cfg = EngineConfig(max_model_len=max_model_len)
    runs = calibration_runs(cfg, max_model_len)
    runs += [long_context_run(cfg, max_model_len, 5e3), full_batch_run(cfg, max_model_len, 5e3)]
    for run in runs:
        assert run.prompt_tokens + max(run.outputs()) <= max_model_len, run
    shared = [r.shared for r in runs if r.shared]
    assert shared == ([] if max_model_len - 20 < cfg.block_size else [shared[0]])
    assert all(s % cfg.block_size == 0 for s in shared)
    full = full_batch_run(cfg, max_model_len, 1e9)
    assert full.sequences == cfg.max_num_seqs
