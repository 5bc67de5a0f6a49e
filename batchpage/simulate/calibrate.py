"""This machine's step cost, measured: a few generate calls of the real engine on the model's own
shapes (random prompts; decodes at several batch sizes, a long context, full prefill chunks),
each step timed, then the same calls replayed in the simulator (which takes the engine's very
steps: tests/simulate/test_simulator.py) and the Efficiency fitted that makes the modelled
steps take the measured time (simulate/fit.py). Each run gives two groups to the fit, its steps
with prompt tokens and its decode-only steps, so that neither kind's cost hides in the other's.

The result is cached (`CalibrationCache`) under a key of everything that decides step costs:
the model's shape and weight format, the dtype, the CPU (model, flags) and torch's thread count
or the GPU, the torch build and the engine settings that pick kernels. A second dry run of the
same setup measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict
from typing import Any, NamedTuple

import torch

from batchpage.cpu_info import cpu_flags, cpu_model
from batchpage.engine.config import EngineConfig
from batchpage.engine.sequence import Request
from batchpage.host_memory import resident_bytes
from batchpage.model.loader import ModelSource
from batchpage.sampling_params import SamplingParams
from batchpage.simulate.devices import DeviceSpec, cuda_datasheet, this_cpu
from batchpage.simulate.fit import FitGroup, fit_efficiency
from batchpage.simulate.measured import CALIBRATION_VERSION, CalibrationCache, MeasuredDevice
from batchpage.simulate.memory import host_runtime_bytes
from batchpage.simulate.simulator import SimRequest, simulate
from batchpage.simulate.step_cost import Efficiency, ModelShape, StepCost, StepWork

# EngineConfig fields that pick kernels or how a step runs, so its cost.
_ENGINE_KEYS = (
    "attention_backend", "linear_backend", "batch_invariant", "quantized_weights",
    "int8_activations", "block_size", "tensor_parallel_size", "enforce_eager", "enable_lora",
)  # fmt: skip


# Rounds of the calibration runs at most (a fast model repeats them until min_seconds).
MAX_ROUNDS = 5
# Prompt tokens the sequences of the shared-prefix run have alike.
SHARED_PREFIX = 256
# Seconds of prefill the long-context run may take (its sequences are sized to them).
LONG_RUN_SECONDS = 3.0
# The full-batch run: its prompts' and outputs' tokens, and the seconds of prefill it may take.
FULL_BATCH_PROMPT = 32
FULL_BATCH_OUTPUT = 64
FULL_BATCH_SECONDS = 2.0


class CalibrationRun(NamedTuple):
    sequences: int
    prompt_tokens: int
    output_tokens: int
    output_spread: int = 0  # request i generates output_tokens + i % (spread + 1)
    shared: int = 0  # of prompt_tokens, the first ones every sequence of the run has alike

    def outputs(self) -> list[int]:
        return [self.output_tokens + i % (self.output_spread + 1) for i in range(self.sequences)]


def calibration_runs(cfg: EngineConfig, max_model_len: int) -> list[CalibrationRun]:
    """The timed runs of short contexts: decodes at 1, 8 and 32 running, whose prompts (of 16
    and 64 tokens, so that a prompt token's own cost and its attention's come apart) fill
    prefill chunks too; decodes of 32 sequences behind one shared prefix (its K/V read by every
    one of them, as a job's system prompt is; up to SHARED_PREFIX tokens, fewer where
    max_model_len asks); and one and a half max_num_seqs (at most 384) of short prompts whose
    outputs differ in length, so that steps mix admissions with decodes as a job's do. Runs
    that max_model_len cannot hold are left out."""
    most = cfg.max_num_seqs
    shared = max(0, min(SHARED_PREFIX, (max_model_len - 20) // cfg.block_size * cfg.block_size))
    runs = [
        CalibrationRun(1, 16, 16),
        CalibrationRun(min(8, most), 16, 12),
        CalibrationRun(min(32, most), 16, 8),
        CalibrationRun(min(8, most), 64, 8),
        CalibrationRun(min(32, most), shared + 8, 12, shared=shared),
        CalibrationRun(min(384, most * 3 // 2), 4, 2, output_spread=8),
    ]
    return [r for r in runs if r.prompt_tokens + max(r.outputs()) <= max_model_len]


def long_context_run(cfg: EngineConfig, max_model_len: int, tokens_per_s: float) -> CalibrationRun:
    """Decodes over long contexts, each its own (K/V read from memory, as a job's are): as many
    sequences of up to 384 prompt tokens (2 to 64) as LONG_RUN_SECONDS of prefill at
    `tokens_per_s` (this engine's, measured by the short runs) allow."""
    count = max(2, min(64, cfg.max_num_seqs, int(tokens_per_s * LONG_RUN_SECONDS) // 384))
    # Prompts are admitted about one a step: outputs that outlast the admissions decode all of
    # them together at the end.
    length = max(8, min(384, max_model_len - count - 16))
    return CalibrationRun(count, length, count + 8)


def full_batch_run(cfg: EngineConfig, max_model_len: int, tokens_per_s: float) -> CalibrationRun:
    """Decodes of a full batch over contexts of 32 to 96 tokens (shorter where max_model_len
    asks), as a job's steady state runs: max_num_seqs sequences, or as many as
    FULL_BATCH_SECONDS of prefill at `tokens_per_s` allow (8 at least)."""
    output = min(FULL_BATCH_OUTPUT, max_model_len // 2)
    length = min(FULL_BATCH_PROMPT, max_model_len - output)
    count = max(8, min(cfg.max_num_seqs, int(tokens_per_s * FULL_BATCH_SECONDS) // length))
    return CalibrationRun(count, length, output)


def this_device(device: torch.device, dtype: torch.dtype) -> DeviceSpec:
    """This machine's engine device as the simulator knows it: the CPU's cores at torch's thread
    count, or the GPU's datasheet (ValueError for a GPU it has none of)."""
    if device.type == "cpu":
        return this_cpu(dtype.itemsize, torch.get_num_threads(), overlap=False)
    name = torch.cuda.get_device_name(device)
    spec = cuda_datasheet(name)
    if spec is None:
        raise ValueError(f"no datasheet for the GPU {name!r}: the estimate cannot calibrate it")
    return spec


def calibration_key(
    cfg: EngineConfig, source: ModelSource, dtype: torch.dtype, device: torch.device
) -> dict[str, str]:
    """What decides this machine's step costs for the model (CalibrationCache's key)."""
    shape = ModelShape.of(source.config, dtype.itemsize, dtype.itemsize)
    if device.type == "cpu":
        flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
        where = f"{cpu_model()} flags={flags} threads={torch.get_num_threads()}"
    else:
        where = torch.cuda.get_device_name(device)
    quant = source.config.quant
    return {
        "version": str(CALIBRATION_VERSION),
        "model": json.dumps(asdict(shape), sort_keys=True),
        "weights": f"{source.kind} {quant!r}",
        "dtype": str(dtype),
        "device": where,
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "engine": json.dumps({k: str(getattr(cfg, k)) for k in _ENGINE_KEYS}, sort_keys=True),
    }


def cached_calibration(llm_config: EngineConfig, source: ModelSource, dtype: torch.dtype,
                       device: torch.device) -> MeasuredDevice | None:  # fmt: skip
    """The cached calibration of this setup, or None (then `calibrate` measures one)."""
    return CalibrationCache(calibration_key(llm_config, source, dtype, device)).get()


def calibrate(
    llm: Any, source: ModelSource, load_s: float | None = None, min_seconds: float = 2.0,
    runtime_bytes: int | None = None,
) -> MeasuredDevice:  # fmt: skip
    """Time the calibration runs on `llm`'s engine (an LLM, untyped here: batchpage.llm imports
    this package), fit this machine's Efficiency, cache it and return it. The runs repeat (new
    prompts each round, at most MAX_ROUNDS) until they have taken `min_seconds`, so that a
    fast model's few milliseconds are not all noise. `load_s`: how long LLM(...) took,
    recorded without the linears' measuring; `runtime_bytes`: the process's resident bytes
    before LLM(...), so that what the engine holds beyond its weights and K/V is measured
    (on a CPU engine without tensor-parallel workers)."""
    plan, cfg = llm.plan, llm.config
    spec = this_device(plan.device, plan.dtype)
    weight_bytes = int(llm.engine.weight_bytes)
    shape = ModelShape.of(source.config, weight_bytes / max(1, source.num_weights),
                          plan.dtype.itemsize)  # fmt: skip
    cost = StepCost(shape, spec, Efficiency())
    batched = cfg.batched_tokens(plan.device)
    rng = random.Random(0)
    vocab = source.config.vocab_size
    _time_run(llm, CalibrationRun(2, 8, 2), rng, vocab)  # first calls: allocations, primitives
    groups: dict[str, FitGroup] = {}
    started = time.perf_counter()
    runs = calibration_runs(cfg, plan.max_model_len)
    first_round = len(runs)
    for _ in range(MAX_ROUNDS):
        for run in runs:
            prompts, steps = _time_run(llm, run, rng, vocab)
            pairs = zip(prompts, run.outputs(), strict=True)
            requests = [SimRequest(p, out, out) for p, out in pairs]
            sim = simulate(requests, cfg, plan.num_blocks, plan.max_model_len, cost, batched, True)
            for kind, group in _groups(run, sim.works, steps, sim.swap_seconds):
                was = groups.get(kind, FitGroup([], 0.0))
                groups[kind] = FitGroup([*was.works, *group.works], was.measured_s +
                                        group.measured_s, was.fixed_s + group.fixed_s)  # fmt: skip
        if len(runs) == first_round:  # after the first round: its prefill rate
            rate = _prefill_rate(groups)
            runs += [long_context_run(cfg, plan.max_model_len, rate),
                     full_batch_run(cfg, plan.max_model_len, rate)]  # fmt: skip
        elif time.perf_counter() - started >= min_seconds:
            break
    typical = sorted(g.measured_s / len(g.works) for g in groups.values())[len(groups) // 2]
    starts = [
        Efficiency(overhead_s=typical / 2, per_seq_s=typical / 200, per_prefill_s=typical / 20),
        Efficiency(overhead_s=typical / 20, per_seq_s=typical / 20, per_prefill_s=typical / 2),
    ]
    eff = fit_efficiency(list(groups.values()), cost, starts=starts)
    fitted = StepCost(shape, spec, eff)
    checks = [
        {"run": kind, "measured_s": g.measured_s,
         "modelled_s": sum(fitted.seconds(w) for w in g.works) + g.fixed_s}
        for kind, g in groups.items()
    ]  # fmt: skip
    held = _engine_bytes(llm, runtime_bytes, weight_bytes)
    measuring = float(llm.engine.linear_measurement.get("seconds", 0.0) or 0.0)
    key = calibration_key(cfg, source, plan.dtype, plan.device)
    measured = MeasuredDevice(
        spec, eff, f"calibrated {time.strftime('%Y-%m-%d %H:%M')}",
        load_s=None if load_s is None else max(0.0, load_s - measuring),
        weight_bytes=weight_bytes, per_request_s=_per_request(llm, rng, vocab), checks=checks,
        key=key, engine_bytes=held,
    )  # fmt: skip
    CalibrationCache(key).put(measured)
    return measured


def _engine_bytes(llm: Any, runtime_bytes: int | None, weight_bytes: int) -> int | None:
    """What the process holds now beyond what it held before LLM(...), the weights and the K/V
    pages written: the step's working memory (the allocator keeps a step's freed temporaries:
    host_memory.keep_freed_memory) and the engine's buffers and libraries. None where it is not
    measured: no `runtime_bytes`, a GPU, or ranks in other processes."""
    if runtime_bytes is None or llm.plan.device.type != "cpu" or llm.workers is not None:
        return None
    kv = llm.engine.runner.kv
    pages = resident_bytes([*kv.k, *kv.v])
    return max(0, host_runtime_bytes() - runtime_bytes - weight_bytes - pages)


def _prefill_rate(groups: dict[str, FitGroup]) -> float:
    """Prompt tokens a second in the steps with prompt tokens so far."""
    tokens = sum(w.tokens for g in groups.values() for w in g.works if w.tokens > w.seqs)
    seconds = sum(g.measured_s for k, g in groups.items() if k.endswith("prefill"))
    return tokens / seconds if seconds > 0 else 0.0


def _groups(
    run: CalibrationRun, works: list[StepWork], steps: list[float], fixed_s: float
) -> list[tuple[str, FitGroup]]:
    """A run's steps with prompt tokens and its decode-only steps, as two fit groups; the whole
    run as one where the engine took other steps than the replay (it should not)."""
    tag = f"{run.sequences}x{run.prompt_tokens}+{run.output_tokens}"
    if run.shared:
        tag += f" ({run.shared} shared)"
    if len(works) != len(steps):
        return [(f"{tag} all", FitGroup(works, sum(steps), fixed_s))]
    out = []
    for kind, prefill in (("prefill", True), ("decode", False)):
        picked = [i for i, w in enumerate(works) if (w.tokens > w.seqs) == prefill]
        if picked:
            group = FitGroup([works[i] for i in picked], sum(steps[i] for i in picked))
            out.append((f"{tag} {kind}", group))
    return out


def _per_request(llm: Any, rng: random.Random, vocab: int) -> float:
    """A request's host work in a generate call beyond its engine steps (making the request and
    its output, the call's loop): the same short batch through generate and through the
    engine alone, the difference per request (the median of three tries)."""
    run = CalibrationRun(min(64, llm.config.max_num_seqs), 4, 2)
    params = SamplingParams(temperature=0.0, max_tokens=run.output_tokens, ignore_eos=True)
    tries = []
    kept = llm.stats, llm.run_stats  # the caller's last generate() figures stay its own
    for _ in range(3):
        _, steps = _time_run(llm, run, rng, vocab)
        prompts = _prompts(run, rng, vocab)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        tries.append((time.perf_counter() - start - sum(steps)) / run.sequences)
    llm.stats, llm.run_stats = kept
    return max(0.0, sorted(tries)[1])


def _time_run(
    llm: Any, run: CalibrationRun, rng: random.Random, vocab: int
) -> tuple[list[list[int]], list[float]]:
    """Random prompts generated greedily to exactly their output lengths, through the engine's own
    steps (generate's per-call work is not a step's); each step's seconds."""
    prompts = _prompts(run, rng, vocab)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in run.outputs()]
    engine = llm.engine
    engine.add_requests(
        [Request(i, None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    )
    steps = []
    clock = time.perf_counter
    while engine.has_unfinished():
        start = clock()
        engine.step()
        steps.append(clock() - start)
    return prompts, steps


def _prompts(run: CalibrationRun, rng: random.Random, vocab: int) -> list[list[int]]:
    """Random token ids (above the first few, which tokenizers keep for special tokens), the
    first `run.shared` of them alike in every prompt."""
    shared = [rng.randrange(3, vocab) for _ in range(run.shared)]
    own = run.prompt_tokens - run.shared
    return [shared + [rng.randrange(3, vocab) for _ in range(own)] for _ in range(run.sequences)]
