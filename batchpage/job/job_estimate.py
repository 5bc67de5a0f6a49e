"""This machine's estimate of a running job, window by window, and the ETA that progress.json
gives from it (issue #73 item 3).

The model is the dry run's: the cached calibration of this setup (simulate/calibrate.py) as the
step cost, the real scheduler over the rows' own token ids (simulate/capacity.py `schedule`).
Each window is estimated as it starts, before it generates: simulated on its own (up to
`2 * max_num_seqs` of its rows, evenly spaced, scaled by rows, as the dry run samples a window
larger than its budget), or, once the simulations so far have taken SIM_SHARE of the job's
time, scaled from the simulated windows (prefill by prompt tokens, decode by output budget), so
that past its first window the estimate costs the job a small share of its time at most (the
simulator takes a fair share of a step's host work, which is most of a tiny model's step; a
larger model's windows are all simulated). Output lengths
are plan.output_tokens' (`max` for sample:N: a job generates nothing twice) until SAMPLED_ROWS
rows have finished, then those rows' own.

The ETA is the estimated seconds of the work left (what remains of the window running, the rows
not read yet at the estimated seconds per row read), times the pace measured so far (the
generate calls' seconds over their estimate; the window running counted by the estimated
seconds it has done: its prefill part by prompt tokens handled, the rest by tokens generated),
plus the rows not read yet at the seconds per row measured outside generate calls (reading,
tokenizing), plus the simulations' share of the time so far. Planning and the model's load
come before and are in neither; what the job does after its last window (the final merge, the
commit) is not in it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from batchpage.engine.config import EngineConfig
from batchpage.job.config import JobConfig
from batchpage.metrics import RunStats
from batchpage.simulate.calibrate import cached_calibration
from batchpage.simulate.capacity import (
    Lengths,
    Row,
    WindowSample,
    job_simulated_rows,
    schedule,
)
from batchpage.simulate.measured import MeasuredDevice
from batchpage.simulate.memory import plan_pool, weight_bytes
from batchpage.simulate.options import parse_output_tokens
from batchpage.simulate.step_cost import ModelShape, StepCost

if TYPE_CHECKING:
    from batchpage.job.plan import JobPlan

# The share of the job's time the simulations may take before later windows are scaled from the
# simulated ones instead (the first window is always simulated).
SIM_SHARE = 0.05
# Rows finished before their output lengths replace the assumed ones.
SAMPLED_ROWS = 32
# Output lengths kept to draw from (the first ones finished).
KEPT_LENGTHS = 4096
# Until the first window is done, the pace counts this share of its estimate as run at 1: its
# first steps alone (a few milliseconds of estimate, their warm-up measured) say little.
PACE_PRIOR = 0.1


NOT_CALIBRATED = (
    "this machine has no step-cost calibration of this setup (model shape, dtype, threads, "
    "engine settings): `dry_run=true plan.devices=[this]` measures one (cached), then every job "
    "of the setup carries an estimate"
)


log = logging.getLogger(__name__)
_R = TypeVar("_R")


def _never_stops_the_job(method: Callable[..., _R]) -> Callable[..., _R | None]:
    """A JobEstimate method that fails stops the estimate (`failed` says why, run.json's
    no_estimate) and returns None: the estimate is a report on the job, never a reason for it
    to fail."""

    @functools.wraps(method)
    def guarded(self: JobEstimate, *args: Any, **kwargs: Any) -> _R | None:
        if self.failed is not None:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # any bug or odd input in the estimate: the rows go on
            self.failed = f"the estimate failed ({type(exc).__name__}: {exc}); the job ran on"
            log.warning("%s", self.failed, exc_info=True)
            return None

    return guarded


def job_estimate(
    cfg: JobConfig, plan: JobPlan, done_before: int = 0
) -> tuple[JobEstimate | None, str | None]:
    """The job's estimate, or None and why there is none. A job does not calibrate: the
    calibration's steps cost more than a few seconds, which a small job would notice. An
    estimate that fails to start is none, with why."""
    try:
        return _job_estimate(cfg, plan, done_before)
    except Exception as exc:  # as _never_stops_the_job: the job runs without it
        why = f"the estimate failed ({type(exc).__name__}: {exc}); the job ran without it"
        log.warning("%s", why, exc_info=True)
        return None, why


def _job_estimate(
    cfg: JobConfig, plan: JobPlan, done_before: int
) -> tuple[JobEstimate | None, str | None]:
    if cfg.executor.kind != "local":
        return None, (
            f"executor={cfg.executor.kind}: the rows run on its replicas, which this machine's "
            "calibration does not time"
        )
    engine = EngineConfig(**asdict(cfg.engine))
    cal = cached_calibration(engine, plan.source, plan.engine.dtype, plan.engine.device)
    if cal is None:
        return None, NOT_CALIBRATED
    rows = plan.info.num_rows
    return JobEstimate(engine, plan, cal, cfg.plan.output_tokens, rows, done_before), None


class WindowFigures(NamedTuple):
    """One window's estimate (seconds and counts of the whole window, a simulated subset's
    scaled)."""

    rows: int
    prompt_tokens: int  # every prompt's, once per row (the engine's count)
    budget_tokens: int  # every sample's output budget
    prefill_s: float
    decode_s: float
    preemption_s: float
    host_s: float  # generate's host work per request (the calibration's per_request_s)
    generated_tokens: float
    preemptions: float
    recomputed_tokens: float
    peak_running: int
    simulated: bool

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s + self.preemption_s + self.host_s

    @property
    def work(self) -> int:
        """Token work known without simulating: prompt tokens and output budget."""
        return self.prompt_tokens + self.budget_tokens

    def scaled(self, rows: int, prompt: int, budget: int, host: float) -> WindowFigures:
        """Another window's figures from these (its own rows, tokens and host work): prefill
        in proportion to its prompt tokens, decode and tokens generated to its output budget,
        preemption to its token work."""
        by_prompt = prompt / max(1, self.prompt_tokens)
        by_budget = budget / max(1, self.budget_tokens)
        by_work = (prompt + budget) / max(1, self.work)
        return WindowFigures(
            rows, prompt, budget, self.prefill_s * by_prompt, self.decode_s * by_budget,
            self.preemption_s * by_work, host, self.generated_tokens * by_budget,
            self.preemptions * by_work, self.recomputed_tokens * by_work, self.peak_running,
            False,
        )  # fmt: skip


def sum_figures(windows: list[WindowFigures]) -> WindowFigures:
    """Windows as one (peak_running: the largest; simulated: any)."""
    return WindowFigures(
        *(sum(getattr(w, f) for w in windows) for f in WindowFigures._fields[:-2]),
        max((w.peak_running for w in windows), default=0),
        any(w.simulated for w in windows),
    )  # fmt: skip


class JobEstimate:
    """The running job's estimate and ETA (see the module docstring). The job tells it what
    happens: `rows_read` as it reads a window, `window` before its generate call, `step` after
    each engine step, `finished` for each row, `window_done` after the call, `outside` with the
    window's other seconds."""

    def __init__(
        self, cfg: EngineConfig, plan: JobPlan, cal: MeasuredDevice, output_tokens: str,
        rows_total: int | None, done_before: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        """`rows_total`: the input's rows (None: unknown, then the ETA is of the rows read);
        `done_before`: those an earlier run into the output folder did."""
        self.cfg, self.cal, self.rows_total, self.clock = cfg, cal, rows_total, clock
        self.started = clock()
        source = plan.source
        self.pool = plan_pool(plan.engine, cfg, source.config)
        weights = cal.weight_bytes or weight_bytes(source, plan.engine.dtype)
        shape = ModelShape.of(source.config, weights / max(1, source.num_weights),
                              plan.engine.dtype.itemsize)  # fmt: skip
        self.cost = StepCost(shape, cal.spec, cal.efficiency)  # calibrated on all ranks at once
        wanted = parse_output_tokens(output_tokens)
        given = wanted.kind == "given"
        self.assumed = Lengths("given", (wanted.value,)) if given else Lengths("max")
        self.lengths: list[int] = []  # of rows finished without an error
        self.windows: list[WindowFigures] = []
        self.measured: list[float] = []  # the generate call's seconds of each finished window
        self.running = False  # a window is generating
        self.done_s = 0.0  # of the running window's estimated seconds, done (see `step`)
        self.window_started = 0.0
        self.simulating_s = 0.0  # the simulations' own seconds so far
        self.failed: str | None = None  # why it stopped estimating (a bug), if it did
        self.read = 0  # rows read from the input (resumed and failed ones included)
        self.resumed = 0  # of them: done by an earlier run
        self.done_before = done_before
        self.outside_s = 0.0  # the job's seconds outside generate calls, measured (see `outside`)
        self.outside_rows = 0  # the rows read before the last `outside`

    # --- what the job tells it ------------------------------------------------------------

    @_never_stops_the_job
    def rows_read(self, count: int, resumed: int = 0) -> None:
        """`count` more rows read, `resumed` of them done by an earlier run (before their
        window, if any, is estimated)."""
        self.read += count
        self.resumed += resumed

    @_never_stops_the_job
    def outside(self, seconds: float) -> None:
        """A window's `seconds` outside the model's load and the generate call: reading and
        tokenizing it, bad rows written, its estimate, progress.json."""
        self.outside_s += seconds
        self.outside_rows = self.read

    @_never_stops_the_job
    def window(self, rows: list[Row]) -> None:
        """A window's rows to generate, about to start: estimated now."""
        prompt = sum(len(p) for r in rows for p in r.prompts)
        room = self.pool.max_model_len
        budget = sum(
            r.params.n * min(r.params.max_tokens or room, max(0, room - len(p)))
            for r in rows for p in r.prompts
        )  # fmt: skip
        host = self.cal.per_request_s * len(rows)
        simulated = [w for w in self.windows if w.simulated]
        elapsed = self.clock() - self.started
        if not simulated or self.simulating_s <= SIM_SHARE * elapsed:
            started = self.clock()
            figures = self._simulate(rows, prompt, budget, host)
            self.simulating_s += self.clock() - started
        else:
            figures = sum_figures(simulated).scaled(len(rows), prompt, budget, host)
        self.windows.append(figures)
        self.running, self.done_s, self.window_started = True, 0.0, self.clock()

    @_never_stops_the_job
    def step(self, stats: RunStats) -> None:
        """The running window's figures after an engine step."""
        if not self.running:
            return
        w = self.windows[-1]
        prompt = stats.prefill_tokens_computed + stats.cached_prompt_tokens
        prefilled = min(1.0, prompt / w.prompt_tokens) if w.prompt_tokens else 1.0
        generated = (
            min(1.0, stats.generated_tokens / w.generated_tokens) if w.generated_tokens else 1.0
        )
        self.done_s = w.prefill_s * prefilled + (w.seconds - w.prefill_s) * generated

    @_never_stops_the_job
    def finished(self, lengths: list[int]) -> None:
        """A row finished without an error: its samples' output lengths."""
        if len(self.lengths) < KEPT_LENGTHS:
            self.lengths += lengths[: KEPT_LENGTHS - len(self.lengths)]

    @_never_stops_the_job
    def window_done(self) -> None:
        if self.running:
            self.measured.append(self.clock() - self.window_started)
            self.running = False

    # --- what it says ---------------------------------------------------------------------

    @property
    def pace(self) -> float:
        """Measured generating seconds over their estimate, so far (1 before any; see
        PACE_PRIOR)."""
        if not self.windows:
            return 1.0
        prior = 0.0 if self.measured else PACE_PRIOR * self.windows[0].seconds
        est = prior + sum(w.seconds for w in self.windows[: len(self.measured)])
        spent = prior + sum(self.measured)
        if self.running:
            est += self.done_s
            spent += self.clock() - self.window_started
        return spent / est if est > 0 else 1.0

    @_never_stops_the_job
    def eta_s(self) -> float | None:
        """Seconds left (None before the first window is estimated)."""
        todo = self.read - self.resumed
        if not self.windows or not todo:
            return None
        left = self.windows[-1].seconds - self.done_s if self.running else 0.0
        unread = max(0, (self.rows_total or 0) - self.read)
        # Of the rows not read, those an earlier run did are read and skipped, no more.
        unread_todo = max(0, unread - max(0, self.done_before - self.resumed))
        per_row = sum(w.seconds for w in self.windows) / todo
        # The simulations so far are not a row's reading: the windows left take their share of
        # the time left, as the windows so far did (at most SIM_SHARE, see `window`).
        reading = self.outside_s - self.simulating_s
        outside = reading / self.outside_rows if self.outside_rows else 0.0
        elapsed = self.clock() - self.started
        share = min(SIM_SHARE, self.simulating_s / elapsed) if elapsed > 0 else 0.0
        return ((left + unread_todo * per_row) * self.pace + unread * outside) * (1 + share)

    @_never_stops_the_job
    def report(self, setup_s: float) -> dict[str, Any]:
        """The estimate of the run for run.json, in the dry run's form (simulate/capacity.py
        wall_parts): planning (`setup_s`, measured) and the model's load (the calibration's),
        the I/O (the seconds outside generate calls, measured; generate's host work per
        request), prefill, decode and preemption of every window generated."""
        total = sum_figures(self.windows)
        parts = {
            "setup": setup_s + (self.cal.load_s or 0.0),
            "io": self.outside_s + total.host_s,
            "prefill": total.prefill_s,
            "decode": total.decode_s,
            "preemption": total.preemption_s,
        }
        return {
            "wall_s": sum(parts.values()),
            "parts_s": parts,
            "generated_tokens": round(total.generated_tokens),
            "preemptions": round(total.preemptions),
            "recomputed_tokens": round(total.recomputed_tokens),
            "peak_running": total.peak_running,
            "windows": len(self.windows),
            "windows_simulated": sum(w.simulated for w in self.windows),
            "source": self.cal.source,
            "output_tokens": self._lengths_said(),
        }

    # --- inside ----------------------------------------------------------------------------

    def _current_lengths(self) -> Lengths:
        if len(self.lengths) >= SAMPLED_ROWS:
            return Lengths("sampled", tuple(self.lengths))
        return self.assumed

    def _lengths_said(self) -> str:
        first = "max_tokens" if self.assumed.kind == "max" else f"{self.assumed.values[0]} tokens"
        if len(self.lengths) < SAMPLED_ROWS:
            return first
        return f"{first}, then the lengths of the rows generated before each window"

    def _simulate(self, rows: list[Row], prompt: int, budget: int, host: float) -> WindowFigures:
        sample = WindowSample(job_simulated_rows(self.cfg), len(rows))
        sample.add(rows)
        lengths = self._current_lengths()
        sim = schedule(sample, self.cfg, self.pool, self.cost, lengths, lengths.kind == "max")
        k = sample.scale
        return WindowFigures(
            len(rows), prompt, budget, sim.prefill_seconds * k, sim.decode_seconds * k,
            (sim.recompute_seconds + sim.swap_seconds) * k, host, sim.generated_tokens * k,
            sim.preemptions * k, sim.recomputed_tokens * k, sim.peak_running, True,
        )  # fmt: skip
