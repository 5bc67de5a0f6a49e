"""Timing a linear shape's candidates, and how far such a timing can be trusted.

Other work on a shared machine does not slow every candidate alike: an implementation whose
threads meet at a barrier after each block waits for a descheduled thread, one that splits the
work differently waits less, so a measurement taken while the machine is busy can rank them
in another order than a quiet one does. A timing therefore says how it went (`judge`):

- the run share: of the time this process's threads were ready to run, the part they ran
  (Linux's per-thread run-queue wait, /proc/self/task/*/schedstat; where that cannot be read,
  the measuring thread's CPU time against the wall clock). A thread of ours that sleeps does
  not count, so a quiet machine reads about 1 whatever the threads do; below BUSY_SHARE the
  machine was busy;
- the spread of its repeats (the median over the fastest, of the winner and of the runner-up:
  one late repeat, a single preemption, does not count, a machine whose every repeat wanders
  does) against the winner's margin over the runner-up: a lead smaller than the spread cannot
  be told from noise;
- the load average per CPU, recorded for the report only: it lags by a minute and, in a
  container, counts the host's other tenants, so it decides nothing.

Every reading goes through a `Clock`, the seam tests replace.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from batchpage.ops.linear import LinearOp

# Timed calls per candidate and row count, after one warm-up call; the median is kept.
REPEATS = 3
# Below this run share the machine was busy: the timing may rank the candidates wrongly.
BUSY_SHARE = 0.9
# Repeats spread wider than this (median / fastest) are noise unless the winner leads by more.
NOISY_SPREAD = 1.2
# A cached choice loses its spot check when slower than the runner-up by more than this
# factor (and more than the spot check's own spread).
LOSS_MARGIN = 1.15


class CpuTimes(NamedTuple):
    ran: float  # seconds this process's threads have run
    waited: float  # seconds they were ready to run while other work held the CPUs


def cpu_times() -> CpuTimes:
    """This process's threads' seconds on a CPU and in the run queue (Linux's schedstat); where
    that cannot be read, the calling thread's CPU time, and the rest of the wall clock as waited
    (which cannot tell waiting from sleeping, so it errs towards busy: measured again)."""
    ran = waited = 0
    try:
        tasks = list(os.scandir("/proc/self/task"))
    except OSError:
        tasks = []
    for task in tasks:
        try:
            with open(os.path.join(task.path, "schedstat")) as f:
                fields = f.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    if ran <= 0:  # no schedstat here (or the kernel keeps none)
        cpu = time.thread_time()
        return CpuTimes(cpu, time.perf_counter() - cpu)
    return CpuTimes(ran / 1e9, waited / 1e9)


def load_per_cpu() -> float | None:
    """The 1-minute load average over the CPUs this process may run on; None where the OS
    has none."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return load / max(cpus, 1)


@dataclass(frozen=True)
class Clock:
    """What a timing reads: the wall clock, this process's CPU times, the machine's load."""

    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], CpuTimes] = cpu_times
    load: Callable[[], float | None] = load_per_cpu


class RowTimes(NamedTuple):
    """One row count's timing: each candidate's repeats (seconds a call), this process's CPU
    times over them, and the load average per CPU after them."""

    repeats: dict[str, list[float]]
    ran: float
    waited: float
    load: float | None


def time_linears(
    modules: dict[str, LinearOp],
    rows: int,
    in_features: int,
    dtype: torch.dtype,
    clock: Clock | None = None,
    repeats: int = REPEATS,
) -> RowTimes:
    """Each module's seconds a call on the same `rows` random rows, `repeats` times after a
    warm-up call, the candidates taking turns, so that a burst of other load on a shared
    machine falls on all of them rather than on one."""
    clock = clock or Clock()
    x = torch.randn(rows, in_features, dtype=dtype)
    for module in modules.values():
        module.apply(x, None)  # first call: allocations, oneDNN's primitive creation
    times: dict[str, list[float]] = {name: [] for name in modules}
    before = clock.cpu()
    for _ in range(repeats):
        for name, module in modules.items():
            start = clock.wall()
            module.apply(x, None)
            times[name].append(clock.wall() - start)
    after = clock.cpu()
    return RowTimes(times, after.ran - before.ran, after.waited - before.waited, clock.load())


def medians(samples: Sequence[RowTimes]) -> dict[str, list[float]]:
    """Each candidate's median time at each row count of `samples`."""
    names = samples[0].repeats
    return {n: [statistics.median(s.repeats[n]) for s in samples] for n in names}


def scores(timings: dict[str, list[float]]) -> dict[str, float]:
    """Each candidate's sum of log(time / the fastest candidate's time) over the row counts:
    the smaller, the better (every row count weighs the same, whatever its size)."""
    counts = len(next(iter(timings.values())))
    best = [min(t[i] for t in timings.values()) for i in range(counts)]
    return {
        name: sum(math.log(t / b) for t, b in zip(times, best, strict=True))
        for name, times in timings.items()
    }


def fastest(timings: dict[str, list[float]]) -> str:
    """The candidate whose times, each relative to the fastest candidate's at that row count,
    have the smallest geometric mean."""
    score = scores(timings)
    return min(timings, key=lambda name: score[name])


def run_share(samples: Sequence[RowTimes]) -> float:
    """Of the time this process's threads were ready to run during `samples`, the part they
    ran (1.0 where nothing was read)."""
    ran = sum(max(s.ran, 0.0) for s in samples)
    waited = sum(max(s.waited, 0.0) for s in samples)
    return ran / (ran + waited) if ran + waited > 0 else 1.0


def _spread(repeats: list[float]) -> float:
    """The median repeat over the fastest."""
    low = min(repeats)
    return statistics.median(repeats) / low if low > 0 else math.inf


@dataclass(frozen=True)
class Trust:
    """How one measurement of a shape went: `reliable` where neither busy nor noisy."""

    runner_up: str | None  # the candidate second to the winner (None: it had no rival)
    run_share: float  # see run_share
    spread: float  # the winner's and runner-up's median / fastest repeat, geometric mean
    margin: float  # the runner-up's relative time over the winner's, geometric mean (>1: a lead)
    load: float | None  # the load average per CPU, at its highest during the measurement

    @property
    def busy(self) -> bool:
        return self.run_share < BUSY_SHARE

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD and self.margin < self.spread

    @property
    def reliable(self) -> bool:
        return not self.busy and not self.noisy

    def why(self) -> str:
        """Why it is not reliable, in words (empty where it is)."""
        parts = []
        if self.busy:
            parts.append(f"busy: our threads ran {self.run_share:.0%} of their ready time")
        if self.noisy:
            parts.append(f"noisy: repeats spread {self.spread:.2f}x, lead {self.margin:.2f}x")
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        """Its figures, JSON-able (run.json's linear_measurement, the choice cache)."""
        load = None if self.load is None else round(self.load, 3)
        spread = round(self.spread, 3) if math.isfinite(self.spread) else None
        return {"load": load, "run_share": round(self.run_share, 3), "spread": spread,
                "margin": round(self.margin, 3)}  # fmt: skip


def judge(samples: Sequence[RowTimes], winner: str) -> Trust:
    """How far `samples` (one per row count) can be trusted to have found `winner`."""
    timings = medians(samples)
    score = scores(timings)
    rivals = [n for n in timings if n != winner]
    runner_up = min(rivals, key=lambda n: score[n]) if rivals else None
    pair = [winner] if runner_up is None else [winner, runner_up]
    spreads = [max(_spread(s.repeats[n]) for n in pair) for s in samples]
    spread = math.exp(statistics.fmean(math.log(x) for x in spreads))
    margin = 1.0
    if runner_up is not None:
        margin = math.exp((score[runner_up] - score[winner]) / len(samples))
    loads = [s.load for s in samples if s.load is not None]
    return Trust(runner_up, run_share(samples), spread, margin, max(loads) if loads else None)


@dataclass(frozen=True)
class Spot:
    """A cached choice timed against its rival(s) at one row count."""

    rival: str  # the fastest rival there
    loss: float  # the choice's median time over the rival's (>1: the choice is slower)
    spread: float  # the two's median / fastest repeat, the larger
    run_share: float

    @property
    def busy(self) -> bool:
        return self.run_share < BUSY_SHARE

    @property
    def lost(self) -> bool:
        """Slower by more than LOSS_MARGIN and than its own noise, on a machine not busy."""
        return not self.busy and self.loss > LOSS_MARGIN and self.loss > self.spread

    def record(self) -> dict[str, Any]:
        spread = round(self.spread, 3) if math.isfinite(self.spread) else None
        return {"spot_rival": self.rival, "spot_loss": round(self.loss, 3),
                "spot_spread": spread, "spot_run_share": round(self.run_share, 3)}  # fmt: skip


def spot_check(sample: RowTimes, chosen: str) -> Spot:
    """`chosen` against the fastest of the other candidates in `sample`."""
    times = {n: statistics.median(t) for n, t in sample.repeats.items()}
    rival = min((n for n in times if n != chosen), key=lambda n: times[n])
    loss = times[chosen] / times[rival] if times[rival] > 0 else math.inf
    spread = max(_spread(sample.repeats[chosen]), _spread(sample.repeats[rival]))
    return Spot(rival, loss, spread, run_share([sample]))
