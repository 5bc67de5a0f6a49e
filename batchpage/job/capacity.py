"""The dry run's capacity plan: the job's sampled rows (from the dry run's pass)
through simulate.estimate.plan_capacity, on the devices and output lengths `plan.*` asks for.

The model loads only where something must run for real: `this` among plan.devices with no
cached calibration of this setup (then a few seconds of calibration steps), or
plan.output_tokens=sample:N (N of the job's rows, picked evenly over the sample, generated with
their own params: their output lengths become the estimate's).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from batchpage.engine.config import EngineConfig
from batchpage.job.config import JobConfig
from batchpage.simulate.calibrate import cached_calibration, calibrate
from batchpage.simulate.capacity import Row, WindowSample
from batchpage.simulate.devices import parse_device
from batchpage.simulate.estimate import HereFacts, plan_capacity
from batchpage.simulate.llm_estimate import lengths_for
from batchpage.simulate.measured import MeasuredDevice
from batchpage.simulate.memory import host_runtime_bytes, weight_bytes
from batchpage.simulate.options import parse_output_tokens

if TYPE_CHECKING:
    from batchpage.job.plan import JobPlan


def job_capacity(
    cfg: JobConfig, plan: JobPlan, sample: WindowSample, setup_s: float, io_s: float,
    full_batch_blocks: int, blocks_used: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The capacity plan of the job as the dry run reports it (see the module docstring).
    `full_batch_blocks`: the KV blocks of max_num_seqs of the longest rows; `blocks_used`: the
    blocks the job allocates in all (its rows', shared prefixes once)."""
    options = cfg.plan
    devices = [parse_device(d) for d in options.devices]
    wanted = parse_output_tokens(options.output_tokens)
    engine = EngineConfig(**asdict(cfg.engine))
    source, eplan = plan.source, plan.engine
    runtime = host_runtime_bytes()  # before any engine loads here
    cal: MeasuredDevice | None = None
    if any(d.name == "this" for d in devices):
        cal = cached_calibration(engine, source, eplan.dtype, eplan.device)
    llm = None
    if (cal is None and any(d.name == "this" for d in devices)) or wanted.kind == "sample":
        started = time.perf_counter()  # the engine's import is part of a job's load too
        from batchpage.llm import LLM  # here: a dry run that estimates nothing loads no engine

        llm = LLM(cfg.model.path, **asdict(cfg.engine))
        load_s = time.perf_counter() - started
    try:
        if llm is not None and cal is None and any(d.name == "this" for d in devices):
            cal = calibrate(llm, source, load_s, runtime_bytes=runtime)
        lengths, facts = lengths_for(wanted, llm, sample)
    finally:
        if llm is not None and llm.workers is not None:  # tensor-parallel ranks
            llm.workers.close()
    here = HereFacts(eplan, weight_bytes(source, eplan.dtype), cal, setup_s, io_s, runtime,
                     blocks_used, cal.engine_bytes if cal else None)  # fmt: skip
    result = plan_capacity(sample, engine, source, here, devices, lengths, full_batch_blocks)
    found = result.as_dict()
    if not found["devices"]:
        del found["devices"]
    return {
        **found,
        "output_tokens": facts,
        "rows_simulated": sum(len(w) for w in sample.windows),
    }


def window_rows(prepared: list[Any], task: str) -> list[Row]:
    """The simulator's rows of a prepared window (job.prompts.Prepared): a pooling job's
    prompts each run once, one step past their prompt."""
    if task == "generate":
        return [Row(p.prompts, p.params) for p in prepared]
    from batchpage.sampling_params import SamplingParams

    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return [Row(p.prompts, once) for p in prepared]
