"""plan_capacity: a job's (or a generate call's) rows on each device asked, and what it must be
warned of. Shared by the dry run (batchpage/job/capacity.py) and LLM.estimate.

Devices: `this` (this machine: the engine plan's pool, its step cost measured by calibration),
a datasheet GPU (simulate/devices.py) at a TP size under batchpage's GPU efficiency
(simulate/gpu_efficiency.py), or a device file (a calibration measured elsewhere). Without
`this` among them, this machine's schedule is still simulated (preemption does not depend on
step times), under an unfitted cost whose seconds are not reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpage.engine.config import EngineConfig
from batchpage.engine.plan import EnginePlan
from batchpage.model.loader import ModelSource
from batchpage.simulate.capacity import Estimate, Lengths, Target, WindowSample, estimate_on
from batchpage.simulate.devices import GPUS, DeviceName, this_cpu
from batchpage.simulate.gpu_efficiency import h200_measured
from batchpage.simulate.measured import MeasuredDevice, load_device
from batchpage.simulate.memory import (
    Pool,
    device_pool,
    host_runtime_bytes,
    job_memory,
    plan_pool,
    weight_bytes,
)  # fmt: skip
from batchpage.simulate.step_cost import Efficiency, ModelShape


@dataclass
class CapacityPlan:
    here: Estimate  # this machine (timed only where `this` was asked)
    devices: list[Estimate]  # the others asked, in order
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "this_machine": self.here.as_dict(),
            "devices": [d.as_dict() for d in self.devices],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class HereFacts:
    """What is measured or known of this machine for the estimate."""

    plan: EnginePlan
    weights: int  # bytes (the checkpoint's headers at the dtype, or the loaded model's)
    calibration: MeasuredDevice | None  # None: not asked for (`this` not among the devices)
    setup_s: float = 0.0  # planning the job and loading the model
    io_s: float = 0.0  # reading and tokenizing every row
    # The process's own resident bytes (interpreter, torch, tokenizer), measured before any
    # engine loads; None: now (memory.host_runtime_bytes).
    runtime_bytes: int | None = None
    blocks_used: int | None = None  # KV blocks the job allocates in all (None: unknown)
    # The step's working memory a calibration measured in a process that started bare, as a
    # job's does (None: modelled; a process that holds its engine already counts it in runtime).
    engine_bytes: int | None = None


def plan_capacity(
    sample: WindowSample,
    cfg: EngineConfig,
    source: ModelSource,
    here: HereFacts,
    devices: Sequence[DeviceName],
    lengths: Lengths,
    full_batch_blocks: int | None = None,
) -> CapacityPlan:
    """Estimates on this machine and on each device; warnings for rows that outgrow the pool
    and devices the model does not fit. `full_batch_blocks`: the KV blocks of the max_num_seqs
    longest sequences (None: unknown). Where they fit this machine's pool and its wall time
    was not asked for, its schedule is not simulated: no step can run out of blocks, so
    nothing is preempted (the default dry run stays a tokenizing pass)."""
    model = source.config
    tp = cfg.tensor_parallel_size
    pool = plan_pool(here.plan, cfg, model)
    on_cpu = here.plan.device.type == "cpu"
    cal = here.calibration
    spec = cal.spec if cal else this_cpu(here.plan.dtype.itemsize)
    weights = cal.weight_bytes if cal and cal.weight_bytes else here.weights
    target = Target(
        "this", spec, tp, cal.efficiency if cal else Efficiency(),
        cal.source if cal else "not timed (plan.devices=[this] measures it)", True,
        here.setup_s + ((cal.load_s or 0.0) if cal else 0.0), cal.per_request_s if cal else 0.0,
    )  # fmt: skip
    runtime = here.runtime_bytes if here.runtime_bytes is not None else host_runtime_bytes()
    memory = job_memory(pool, cfg, model, weights, spec, tp, runtime if on_cpu else None,
                        here.blocks_used, here.engine_bytes)  # fmt: skip
    shape = ModelShape.of(model, weights / max(1, source.num_weights), here.plan.dtype.itemsize)
    if cal is None and full_batch_blocks is not None and full_batch_blocks <= pool.num_blocks:
        unneeded = {"preemptions": 0, "recomputed_tokens": 0, "simulated": False}
        mine = Estimate(target, pool, memory, bound=unneeded)
    else:
        mine = estimate_on(target, sample, cfg, shape, pool, memory, lengths, here.io_s)
    if cal is None:  # schedule only: its seconds come from an unfitted cost
        for figures in (mine.bound, mine.estimate):
            figures.pop("wall_s", None)
            figures.pop("parts_s", None)
    plan = CapacityPlan(mine, [])
    for name in devices:
        if name.name != "this":  # this machine is `here`, timed since asked
            plan.devices.append(_elsewhere(name, sample, cfg, source, lengths, here.io_s))
    plan.warnings += _warnings(plan, pool, cfg, sample, full_batch_blocks or 0)
    return plan


def _elsewhere(
    name: DeviceName, sample: WindowSample, cfg: EngineConfig, source: ModelSource,
    lengths: Lengths, io_s: float,
) -> Estimate:  # fmt: skip
    if name.name.endswith(".json"):
        measured = load_device(name.name)
        spec, eff, why = measured.spec, measured.efficiency, f"{name.name}: {measured.source}"
    else:
        spec, eff = GPUS[name.name], h200_measured()
        why = "datasheet; batchpage's GPU efficiency (the H200 run)"
    target = Target(name.label, spec, name.tp, eff, why)
    if name.tp > spec.max_tp:
        return Estimate(target, None, None, f"a {spec.name} node has {spec.max_tp} devices")
    model = source.config
    pool = device_pool(cfg, source, spec, name.tp)
    if isinstance(pool, str):
        return Estimate(target, None, None, pool)
    weights = weight_bytes(source, pool.dtype)
    memory = job_memory(pool, cfg, model, weights, spec, name.tp)
    shape = ModelShape.of(model, pool.dtype.itemsize, pool.dtype.itemsize)
    return estimate_on(target, sample, cfg, shape, pool, memory, lengths, io_s)


def _warnings(
    plan: CapacityPlan, pool: Pool, cfg: EngineConfig, sample: WindowSample, full_batch: int
) -> list[str]:
    out = []
    bound = plan.here.bound
    if bound.get("preemptions"):
        need = full_batch * pool.block_bytes * cfg.tensor_parallel_size
        out.append(
            f"the rows outgrow the KV pool ({pool.bytes / 2**20:,.1f} MiB, {pool.num_blocks} "
            f"blocks): at max_tokens the engine would preempt about {bound['preemptions']:,} "
            f"times and recompute about {bound['recomputed_tokens']:,} tokens; "
            f"engine.kv_cache_memory={need} ({need / 2**20:,.1f} MiB: max_num_seqs="
            f"{cfg.max_num_seqs} of the longest rows) avoids it, as does a lower "
            "engine.max_num_seqs"
        )
    elif full_batch > pool.num_blocks and sample.rows_total > 1:
        out.append(
            f"the KV pool ({pool.num_blocks} blocks) holds fewer than max_num_seqs="
            f"{cfg.max_num_seqs} of the longest rows at once ({full_batch} blocks): they run "
            "fewer at a time than they could"
        )
    out += [f"{d.target.label}: {d.problem}" for d in plan.devices if d.problem is not None]
    return out
