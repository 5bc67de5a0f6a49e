"""The Ray rows of BENCHMARKS.md's reliability table, on a multi-node Ray cluster on this
machine (tests/executor/cluster_nodes.py: a head without CPUs and one-CPU worker nodes, each a
raylet of its own, Ray's own health-check settings):

    python -m jobs.bench.ray_nodes --rows 16 --max-tokens 32

1. clean: the job on 2 replicas, uninterrupted; its completions are the reference.
2. node killed: the same job; when `--after` rows are written, every process of replica 1's
   node is SIGKILLed and the node removed (raylet and all); the job finishes on the survivor
   (executor.max_restarts=0).
3. replica replaced: both replicas' nodes killed the same way and a fresh node added; the job
   waits for a replacement, which finishes it (executor.max_restarts=3: until Ray notices a
   killed node is gone, a replacement may be placed there and fail to start, which counts).
   `--cases` picks 2 and 3 (killed, replaced; both by default). For 2 and 3: rows lost,
   duplicated and different from the clean run; seconds from the kill until the driver counted
   a replica lost, until a replacement's first row, and the job's seconds against the clean
   run's.
4. dead address: the job through the command line with executor.address at a port where nothing
   listens, and at one that takes connections but never answers (a socket that listens and never
   reads, as a stuck head does; executor.connect_timeout_s=5): exit code, seconds to the error,
   its first line.
Markdown tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpage.job import run_job
from batchpage.run import compose_job
from jobs.bench.reliability import Comparison, compare
from jobs.bench.report import command_line, cpu_model, fmt, log, markdown_table, parser
from tests.executor.cluster_nodes import killing, start_cluster

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Loss:
    case: str
    result: Comparison
    lost_s: float | None  # from the kill until the driver counted a replica lost
    replacement_s: float | None  # from the kill until a replacement's first row
    job_s: float


def timed_job(args: list[str], pool: type | None) -> tuple[float, Any]:
    """Run the job in this process (through `pool`, a KillsNodes class, when given)."""
    cfg = compose_job(args)
    made: list[Any] = []

    def factory(model: str, **engine: Any) -> Any:
        assert pool is not None
        made.append(pool(model, cfg.executor, **engine))
        return made[-1]

    start = time.monotonic()
    run_job(cfg, factory if pool is not None else None)
    return time.monotonic() - start, made[0] if made else None


def loss_case(case: str, job: list[str], clean: Path, out: Path, pool: type) -> Loss:
    seconds, made = timed_job([*job, f"output_dir={out}"], pool)

    def since_kill(at: float | None) -> float | None:
        return None if at is None or made.killed_at is None else at - made.killed_at

    return Loss(case, compare(clean, out), since_kill(made.lost_at),
                since_kill(made.replacement_row_at), seconds)  # fmt: skip


def dead_address(case: str, job: list[str], address: str, out: Path) -> tuple:
    """The job through the command line at an address that does not answer."""
    cmd = [sys.executable, "-m", "batchpage.run", *job, f"output_dir={out}",
           f"executor.address={address}", "executor.connect_timeout_s=5",
           f"hydra.run.dir={out.parent}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent)
    seconds = time.monotonic() - start
    said = next((line for line in done.stderr.splitlines() if line.startswith("error")), "")
    return case, done.returncode, fmt(seconds), said.replace("|", "\\|")[:200]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = parser(__doc__, smoke=False)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--after", type=int, default=2, help="rows written before the kill")
    p.add_argument("--dataset", default="evals")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    p.add_argument("--cases", default="killed,replaced", help="loss cases 2 and 3 to run")
    args = p.parse_args()
    import ray

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ray-nodes-"))
    job = [
        f"dataset={args.dataset}", f"dataset.limit={args.rows}", f"model.path={args.model}",
        f"sampling.max_tokens={args.max_tokens}", "sampling.ignore_eos=true", "flush_rows=1",
        "progress=false", "executor=ray", "executor.num_replicas=2", "executor.window_rows=2",
    ]  # fmt: skip
    print(f"command: `{command_line()}`  \nCPU: {cpu_model()}  \njob: `{' '.join(job)}`\n")

    losses, clean = [], workdir / "clean"
    cases = {
        "killed": ("node killed mid-job", (1,), {"executor.max_restarts": 0}, 0),
        "replaced": ("every replica's node killed, one node added later", (0, 1),
                     {"executor.max_restarts": 3}, 1),
    }  # fmt: skip
    unknown = set(args.cases.split(",")) - set(cases)
    if unknown:
        p.error(f"unknown --cases {sorted(unknown)}; known: {', '.join(cases)}")
    chosen = [cases[name] for name in cases if name in args.cases.split(",")]
    for case, victims, settings, later in [("clean", (), {}, 0), *chosen]:
        cluster = start_cluster(2)
        try:
            if case == "clean":
                clean_s, _ = timed_job([*job, f"output_dir={clean}"], None)
                log(f"clean run: {clean_s:.1f} s")
                continue
            pool = killing(cluster, victims, after=args.after, later=later)
            extra = [f"{k}={v}" for k, v in settings.items()]
            losses.append(loss_case(case, [*job, *extra], clean, workdir / f"case{len(losses)}",
                                    pool))  # fmt: skip
            log(f"{case}: {losses[-1]}")
        finally:
            ray.shutdown()
            cluster.shutdown()
    rows = [
        (x.case, x.result.rows, x.result.lost, x.result.duplicated, x.result.different,
         fmt(x.lost_s), fmt(x.replacement_s), f"{fmt(x.job_s)} ({fmt(clean_s)})")
        for x in losses
    ]  # fmt: skip
    headers = ["loss", "rows", "lost", "duplicated", "different", "lost noticed after s",
               "replacement's first row after s", "job s (clean)"]  # fmt: skip
    print(markdown_table(headers, rows), "\n")

    log("dead addresses")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        dead = [
            dead_address("nothing listens at the port", job, f"127.0.0.1:{free_port()}",
                         workdir / "refused"),
            dead_address("takes connections, never answers", job,
                         f"127.0.0.1:{silent.getsockname()[1]}", workdir / "silent"),
        ]  # fmt: skip
    headers = ["dead address", "exit", "seconds to the error", "first line"]
    print(markdown_table(headers, dead))


if __name__ == "__main__":
    main()
