"""A job's capacity plan: for each device asked (this machine, a datasheet GPU at a TP size, a
measured device), the pool the engine gets there, whether the rows preempt and how much, the
peak memory, and the wall time in parts (setup, I/O, prefill, decode, preemption), as a range:
every row generating its max_tokens (the bound) and the output-length estimate (a given
length, or the lengths of rows generated for real).

The schedule comes from the simulator over the job's own token ids (the real scheduler, KV
manager and radix cache; simulate_windows runs the windows as the job's generate calls do). A
large job is not simulated whole: `WindowSample` keeps up to max_rows rows' worth of whole
windows, picked uniformly over the job (reservoir sampling, seeded), and the simulated figures
are scaled by rows to generate / rows simulated.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batchpage.engine.config import EngineConfig
from batchpage.sampling_params import SamplingParams
from batchpage.simulate.devices import DeviceSpec
from batchpage.simulate.memory import Memory, Pool
from batchpage.simulate.simulator import SimRequest, SimResult, simulate_windows
from batchpage.simulate.step_cost import Efficiency, ModelShape, StepCost


class Row(NamedTuple):
    """What the simulator needs of a row: each prompt it runs (its token ids) and its
    SamplingParams (max_tokens, n, ignore_eos; the seed and the rest when it is generated for
    real to learn output lengths)."""

    prompts: list[list[int]]
    params: SamplingParams


class WindowSample:
    """Up to `max_rows` rows' worth of whole windows (at least one), each window of the job
    equally likely to be kept; `windows` in the job's order; `rows_total` counts every row
    added, kept or not."""

    def __init__(self, max_rows: int, window_rows: int, seed: int = 0) -> None:
        self.max_rows = max_rows
        self.keep = max(1, max_rows // max(1, window_rows))
        self.rng = random.Random(seed)
        self.seen = 0
        self.kept: list[tuple[int, list[Row]]] = []
        self.rows_total = 0  # rows to generate in the whole job
        self.first_window_rows = 0  # rows to generate in the job's first window with any

    def add(self, window: list[Row]) -> None:
        """One window of the job (a window larger than max_rows is kept as max_rows of its
        rows, evenly spaced: the engine's steady state is the same with fewer rows queued)."""
        self.rows_total += len(window)
        if not self.first_window_rows:
            self.first_window_rows = len(window)
        if len(window) > self.max_rows:
            window = [window[i * len(window) // self.max_rows] for i in range(self.max_rows)]
        if len(self.kept) < self.keep:
            self.kept.append((self.seen, window))
        else:
            j = self.rng.randrange(self.seen + 1)
            if j < self.keep:
                self.kept[j] = (self.seen, window)
        self.seen += 1

    @property
    def windows(self) -> list[list[Row]]:
        return [w for _, w in sorted(self.kept, key=lambda kw: kw[0])]

    @property
    def scale(self) -> float:
        """Rows to generate in the job per row simulated."""
        sampled = sum(len(w) for _, w in self.kept)
        return self.rows_total / sampled if sampled else 0.0


class Lengths(NamedTuple):
    """The output-length estimate: `max` (every row its max_tokens: the estimate is the bound),
    one `given` length, or the `sampled` lengths of rows generated for real (each simulated row
    draws one, seeded)."""

    kind: str
    values: tuple[int, ...] = ()

    def draw(self, budget: int, rng: random.Random) -> int:
        if self.kind == "max" or not self.values:
            return budget
        value = self.values[0] if self.kind == "given" else rng.choice(self.values)
        return max(1, min(budget, value))


@dataclass(frozen=True)
class Target:
    """A device to estimate on: its peaks, TP size and fitted Efficiency; `here`: this machine
    (its engine plan's pool, its measured setup and I/O)."""

    label: str
    spec: DeviceSpec
    tp: int
    efficiency: Efficiency
    source: str
    here: bool = False
    setup_s: float = 0.0  # planning and loading the model (measured here)
    per_request_s: float = 0.0  # a request's host work outside the steps (measured here)


@dataclass
class Estimate:
    """One device's plan. Seconds and counts are the whole job's (a sample's, scaled)."""

    target: Target
    pool: Pool | None
    memory: Memory | None
    problem: str | None = None  # why the job cannot run there
    bound: dict[str, Any] = field(default_factory=dict)  # every row to max_tokens
    estimate: dict[str, Any] = field(default_factory=dict)  # the length estimate

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device": self.target.label, "source": self.target.source}
        if self.problem is not None:
            return {**out, "problem": self.problem}
        assert self.pool is not None and self.memory is not None
        out["kv_pool_blocks"] = self.pool.num_blocks
        ranks = self.target.tp if self.target.here else 1  # a GPU's: its rank's share
        out["kv_pool_bytes"] = self.pool.bytes * ranks
        out["max_model_len"] = self.pool.max_model_len
        out["memory_bytes"] = self.memory.as_dict()
        out["estimate"] = self.estimate or self.bound
        if self.estimate and self.estimate != self.bound:  # else the estimate is the bound
            out["max_tokens_bound"] = self.bound
        if not self.target.here and "wall_s" in out["estimate"]:
            out["device_hours"] = out["estimate"]["wall_s"] * self.target.tp / 3600
        return out


def requests_of(
    windows: Sequence[Sequence[Row]], max_model_len: int, lengths: Lengths, bound: bool
) -> list[list[SimRequest]]:
    """The simulator's requests of each window: every prompt of a row (each of its n samples),
    its budget what max_tokens and max_model_len allow; prompts that max_model_len cannot hold
    are left out (those rows fail on that device)."""
    rng = random.Random(1)
    out = []
    for window in windows:
        requests = []
        for row in window:
            params = row.params
            for ids in row.prompts:
                room = max_model_len - len(ids)
                if room < 1:
                    continue
                budget = min(params.max_tokens or room, room)
                tokens = budget if bound or params.ignore_eos else lengths.draw(budget, rng)
                requests += [SimRequest(ids, budget, tokens, params.ignore_eos)] * params.n
        out.append(requests)
    return out


def schedule(
    sample: WindowSample, cfg: EngineConfig, pool: Pool, cost: StepCost, lengths: Lengths,
    bound: bool,
) -> SimResult:  # fmt: skip
    """The sampled windows through the engine's scheduling on `pool` (unscaled)."""
    windows = requests_of(sample.windows, pool.max_model_len, lengths, bound)
    return simulate_windows(windows, cfg, pool.num_blocks, pool.max_model_len, cost,
                            pool.batched_tokens)  # fmt: skip


def wall_parts(
    sim: SimResult, sample: WindowSample, target: Target, io_s: float, estimating_s: float = 0.0
) -> dict[str, Any]:
    """The job's wall time in parts, and its preemptions, scaled from the sample.
    `estimating_s`: the job's own estimate's seconds (its simulations), counted in its I/O."""
    k = sample.scale
    parts = {
        "setup": target.setup_s,
        "io": io_s + sample.rows_total * target.per_request_s + estimating_s,
        "prefill": sim.prefill_seconds * k,
        "decode": sim.decode_seconds * k,
        "preemption": (sim.recompute_seconds + sim.swap_seconds) * k,
    }
    return {
        "wall_s": sum(parts.values()),
        "parts_s": parts,
        "generated_tokens": round(sim.generated_tokens * k),
        "preemptions": round(sim.preemptions * k),
        "recomputed_tokens": round(sim.recomputed_tokens * k),
        "peak_running": sim.peak_running,
    }


def estimate_on(
    target: Target, sample: WindowSample, cfg: EngineConfig, shape: ModelShape, pool: Pool,
    memory: Memory, lengths: Lengths, io_s: float,
) -> Estimate:  # fmt: skip
    """The plan on one device: the bound, and the estimate where lengths are not the bound."""
    cost = StepCost(shape, target.spec, target.efficiency, 1 if target.here else target.tp)
    result = Estimate(target, pool, memory)
    started = time.perf_counter()
    sim = schedule(sample, cfg, pool, cost, lengths, bound=True)
    # A job on this machine estimates its ETA with the same simulator (job/job_estimate.py):
    # its first window's rows, up to job_simulated_rows(cfg), at this simulation's pace.
    simulated = sum(len(w) for w in sample.windows)
    first = min(sample.first_window_rows, job_simulated_rows(cfg))
    took = time.perf_counter() - started
    estimating = took * first / simulated if target.here and simulated else 0.0
    result.bound = wall_parts(sim, sample, target, io_s, estimating)
    if lengths.kind != "max":
        sim = schedule(sample, cfg, pool, cost, lengths, bound=False)
        result.estimate = wall_parts(sim, sample, target, io_s, estimating)
    return result


def job_simulated_rows(cfg: EngineConfig) -> int:
    """The rows of a window a job's own estimate simulates at most (the rest are scaled)."""
    return 2 * cfg.max_num_seqs


def estimate_error(estimate: dict[str, Any], measured_wall_s: float) -> float | None:
    """run.json's estimate_error: the estimated wall time over the measured one, less 1 (None
    where the estimate has no time: this machine was not calibrated)."""
    wall = estimate.get("wall_s")
    return None if wall is None or measured_wall_s <= 0 else wall / measured_wall_s - 1
