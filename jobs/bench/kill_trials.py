"""kill -9 at random moments, then resume: does the job still produce the clean run's rows?

Each trial runs the job into a fresh folder, kills it with SIGKILL at a random moment of the
phase it aims at (model load, generation, the final merge), reruns the same command to the end
and compares completions.parquet with a clean run's: rows lost, duplicated, or different.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
FINAL = "completions.parquet"
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]
PHASES = ("load", "generation", "merge")


@dataclass(frozen=True)
class Timeline:
    """When a clean run wrote its first shard, its final file, and ended (s from start)."""

    first_shard: float
    final: float
    end: float


@dataclass(frozen=True)
class Comparison:
    rows: int
    lost: int
    duplicated: int
    different: int


@dataclass(frozen=True)
class Trial:
    aimed_at: str
    landed: str  # the phase the kill found the job in, or "ended first"
    at_s: float
    first_exit: int  # of the run that was to be killed: -9 when the kill landed
    shards_left: int
    rerun_exit: int
    result: Comparison
    temps_left: int = 0  # temporary files in the folder after the rerun (a kill's leftovers)


def start_job(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}"]
    with open(log, "w") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)


def shards(out: Path) -> int:
    return len(list(out.glob("shard-*.parquet")))


def merging(out: Path) -> bool:
    return any(out.glob(f".{FINAL}.*.tmp"))


def clean_run(job: list[str], out: Path, workdir: Path) -> Timeline:
    """Run the job to the end, noting when its files appear."""
    proc = start_job([*job, f"output_dir={out}"], workdir, workdir / "clean.log")
    started, first, final = time.monotonic(), None, None
    while proc.poll() is None:
        now = time.monotonic() - started
        if first is None and shards(out):
            first = now
        if final is None and (out / FINAL).exists():
            final = now
        time.sleep(0.02)
    end = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the clean run failed: {(workdir / 'clean.log').read_text()[-2000:]}")
    return Timeline(first or end, final or end, end)


def kill_trial(
    job: list[str], clean: Path, timeline: Timeline, aim: str, out: Path, rng: random.Random
) -> Trial:
    """Start, SIGKILL during `aim`, rerun to the end, compare with the clean output."""
    proc = start_job([*job, f"output_dir={out}"], out.parent, out.parent / f"{out.name}.kill.log")
    started = time.monotonic()
    if aim == "load":  # anywhere before the clean run's first shard
        _sleep_while(proc, rng.uniform(0.0, timeline.first_shard))
    elif aim == "generation":  # after this run's first shard, before the clean run's merge
        while proc.poll() is None and not shards(out):
            time.sleep(0.01)
        _sleep_while(proc, rng.uniform(0.0, max(timeline.final - timeline.first_shard, 0.05)))
    else:  # the merge lasts milliseconds: poll for its temporary file
        while proc.poll() is None and not merging(out) and not (out / FINAL).exists():
            time.sleep(0.0005)
    landed = _phase(out) if proc.poll() is None else "ended first"
    at = time.monotonic() - started
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        landed = "ended first"  # its log (<trial>.kill.log) says why when the exit is not 0
    left = shards(out)
    rerun = start_job([*job, f"output_dir={out}"], out.parent, out.parent / f"{out.name}.log")
    rerun.wait()
    temps = len(list(out.glob(".*.tmp")))
    return Trial(
        aim, landed, at, proc.returncode, left, rerun.returncode, compare(clean, out), temps
    )


def compare(clean: Path, resumed: Path) -> Comparison:
    """Rows of the clean run missing from the resumed one, ids there more than once, and rows
    whose compared columns differ."""
    want = {r["id"]: r for r in pq.read_table(clean / FINAL, columns=COMPARED).to_pylist()}
    if not (resumed / FINAL).exists():
        return Comparison(0, len(want), 0, 0)
    got = pq.read_table(resumed / FINAL, columns=COMPARED).to_pylist()
    ids = [r["id"] for r in got]
    different = sum(1 for r in got if r != want.get(r["id"]))
    return Comparison(len(got), len(set(want) - set(ids)), len(ids) - len(set(ids)), different)


def run_trials(job: list[str], n: int, workdir: Path, seed: int) -> tuple[Timeline, list[Trial]]:
    """A clean run, then n trials aimed at load, generation and merge in turn."""
    rng = random.Random(seed)
    clean = workdir / "clean"
    timeline = clean_run(job, clean, workdir)
    trials = []
    for i in range(n):
        aim = PHASES[i % len(PHASES)]
        trials.append(kill_trial(job, clean, timeline, aim, workdir / f"trial{i}", rng))
        print(f"trial {i + 1}/{n}: {trials[-1]}", file=sys.stderr, flush=True)
    return timeline, trials


def _sleep_while(proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _phase(out: Path) -> str:
    if merging(out) or (out / FINAL).exists():
        return "merge"
    return "generation" if shards(out) else "load"
