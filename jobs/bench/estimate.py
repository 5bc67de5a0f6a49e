"""Issue #73's goals on this machine: the dry run's estimate of three held-out jobs against their
measured runs (wall time within 20%, peak memory within 10%), and progress.json's ETA (within
15% of the time left once a tenth of the rows are done).

    python -m jobs.bench.estimate --out jobs/bench/results/estimate.json  # full size
    python -m jobs.bench.estimate --smoke            # a small run: does it work?

The jobs (none of them the calibration's shapes), each on the tiny random model
(jobs.bench.random_models) and the bundled model (SmolLM2-135M), rows per model below times
--scale:
- short: many short rows (one-line prompts of 4 to 16 words), 16 tokens out;
- prefix: long shared prefixes (jobs/bench/system_prompt.txt, about a thousand tokens, before a
  short question), 32 tokens out;
- long: long outputs (short prompts, 256 tokens out).
Every job generates with ignore_eos (the estimate's output lengths are then exact: what is
measured is the step cost, not an output-length guess).

Per model, the calibration is measured afresh (a cache folder of its own, the linear choices
and tokenizers of the user's cache linked in), by the first dry run. Per job, in fresh
processes: `dry_run=true plan.devices=[this]` (its estimated wall time and peak memory), then
the job (its run.json wall time, the peak RSS of its process from wait4, run.json's own
estimate_error, and progress.json, rewritten every second, read every 0.2 s: the ETA error at
the first record with a tenth of the rows done, and the median of the records up to half; the
time left is to the job's end, when it commits its output and writes run.json, its last file,
not the interpreter's exit after it).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from batchpage.paths import cache_dir
from jobs.bench.random_models import random_model_folder
from jobs.bench.report import environment, log, markdown_table, parser, print_header, save_results

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["summarize", "the", "quick", "brown", "fox", "explain", "why", "a", "poem", "about",
         "rivers", "count", "list", "three", "reasons", "briefly"]  # fmt: skip


class Job(NamedTuple):
    name: str
    rows: dict[str, int]  # per model, at --scale 1
    max_tokens: int
    prefix: bool  # the system prompt before each question


JOBS = {
    "short": Job("short", {"tiny": 20_000, "smollm2": 2_000}, 16, False),
    "prefix": Job("prefix", {"tiny": 4_000, "smollm2": 400}, 32, True),
    "long": Job("long", {"tiny": 1_000, "smollm2": 96}, 256, False),
}
# Where a model name is not one of batchpage's own (a bundled name or a path), the random shape.
RANDOM = {"tiny"}


def write_rows(path: Path, job: Job, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    prefix = (ROOT / "jobs/bench/system_prompt.txt").read_text().strip() if job.prefix else ""
    with open(path, "w") as f:
        for i in range(rows):
            words = " ".join(rng.choices(WORDS, k=rng.randint(4, 16)))
            prompt = f"{prefix}\n\nQuestion {i}: {words}?" if prefix else words
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt}) + "\n")
    return path


def fresh_cache(root: Path) -> Path:
    """A cache folder whose step-cost calibrations start empty, the rest of the user's cache
    (linear choices, converted tokenizers, random models) linked in."""
    folder = Path(tempfile.mkdtemp(prefix="calibration-", dir=root))
    mine = cache_dir()
    if mine.is_dir():
        for entry in mine.iterdir():
            if entry.name != "step_costs":
                (folder / entry.name).symlink_to(entry.resolve())
    return folder


_DRY = (
    "import json, sys; from batchpage.run import compose_job; "
    "from batchpage.job.dry_run import dry_run; "
    "print(json.dumps(dry_run(compose_job(sys.argv[1:]))['this_machine']))"
)
_JOB = (
    "import sys; import batchpage.job.loop as loop; "
    "loop.PROGRESS_EVERY_S = float(sys.argv.pop(1)); "
    "from batchpage.run import main; main()"
)


class Ran(NamedTuple):
    run: dict[str, Any]  # run.json's entry of the run
    peak_rss: int  # bytes
    records: list[tuple[float, dict[str, Any]]]  # progress.json as read, with the time left


def dry(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _DRY, *args, "plan.devices=[this]"], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the dry run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run(args: list[str], env: dict[str, str], out: Path, workdir: Path) -> Ran:
    """The job in its own process: its run.json entry, its peak RSS (the job's own, in that
    entry: wait4's would count this process's pages, held by the child until its exec) and
    progress.json's records (each with the seconds the job then had left, to run.json's writing)."""
    cmd = [sys.executable, "-c", _JOB, "1.0", *args, f"output_dir={out}",
           f"hydra.run.dir={workdir / 'hydra'}"]  # fmt: skip
    with open(workdir / f"{out.name}.log", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    seen: list[tuple[float, dict[str, Any]]] = []  # wall-clock times: run.json's mtime ends it
    last = None
    while True:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            record = json.loads((out / "progress.json").read_text())
        except (OSError, ValueError):
            record = None
        if record is not None and record != last:
            seen.append((time.time(), record))
            last = record
        time.sleep(0.2)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the job failed: see {workdir / (out.name + '.log')}")
    # The job ends when its output is committed and run.json written, its last file; the
    # interpreter's exit after that (its threads, freeing memory) is not the job's time.
    ended = (out / "run.json").stat().st_mtime
    entry = json.loads((out / "run.json").read_text())["runs"][-1]
    return Ran(entry, entry["peak_rss_bytes"], [(ended - t, r) for t, r in seen])


def eta_errors(records: list[tuple[float, dict[str, Any]]]) -> tuple[float | None, float | None]:
    """The ETA error at the first record with a tenth of the rows done, and the median error of
    the records from a tenth to half of the rows (None without such records)."""
    span = [
        r["eta_s"] / left - 1
        for left, r in records
        if r.get("eta_s") is not None and left > 0 and r.get("rows_total")
        and 0.1 <= r["rows_done"] / r["rows_total"] <= 0.5
    ]  # fmt: skip
    return (span[0], statistics.median(span)) if span else (None, None)


def measure(model: str, job: Job, rows: int, workdir: Path, env: dict[str, str]) -> dict:
    path = str(random_model_folder(model)) if model in RANDOM else model
    data = write_rows(workdir / f"{model}-{job.name}.jsonl", job, rows)
    args = [f"model.path={path}", f"dataset.path={data}", f"sampling.max_tokens={job.max_tokens}",
            "sampling.ignore_eos=true", "progress=false"]  # fmt: skip
    log(f"{model} {job.name}: dry run of {rows:,} rows")
    here = dry(args, env)
    log(f"{model} {job.name}: the job")
    ran = run(args, env, workdir / f"out-{model}-{job.name}", workdir)
    estimated = here["estimate"]["wall_s"]
    memory = here["memory_bytes"]["total"]
    wall = ran.run["wall_s"]
    at_tenth, median = eta_errors(ran.records)
    return {
        "model": model, "job": job.name, "rows": rows, "max_tokens": job.max_tokens,
        "estimated_wall_s": estimated, "wall_s": wall, "wall_error": estimated / wall - 1,
        "estimated_peak_bytes": memory, "peak_rss_bytes": ran.peak_rss,
        "memory_error": memory / ran.peak_rss - 1,
        "run_json_estimate_error": ran.run.get("estimate_error"),
        "eta_error_at_tenth": at_tenth, "eta_error_median": median,
        "estimate": here["estimate"], "run_parts_s": ran.run["parts_s"],
        "calibration": here["source"],
    }  # fmt: skip


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2", help="comma list (default: %(default)s)")
    p.add_argument("--jobs", default=",".join(JOBS), help="comma list (default: %(default)s)")
    p.add_argument("--scale", type=float, default=1.0, help="rows per job times this")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    scale = 0.02 if args.smoke else args.scale
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="estimate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env_info = environment()
    print_header("Estimate against measured (issue #73)", env_info, f"rows x {scale:g}")
    headers = ["model", "job", "rows", "est. wall s", "wall s", "error", "est. peak MiB",
               "peak RSS MiB", "error", "run.json estimate_error", "ETA error at 10%",
               "ETA median 10-50%"]  # fmt: skip
    results = []
    for model in args.models.split(","):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BATCHPAGE_CACHE": str(fresh_cache(workdir))}
        for name in args.jobs.split(","):
            job = JOBS[name]
            rows = max(1, round(job.rows[model] * scale)) if model in job.rows else 0
            if not rows:
                raise SystemExit(f"no row count for model {model!r}: give one of {list(job.rows)}")
            found = measure(model, job, rows, workdir, env)
            results.append(found)
            row = [model, name, rows, found["estimated_wall_s"], found["wall_s"],
                   pct(found["wall_error"]), found["estimated_peak_bytes"] / 2**20,
                   found["peak_rss_bytes"] / 2**20, pct(found["memory_error"]),
                   pct(found["run_json_estimate_error"]), pct(found["eta_error_at_tenth"]),
                   pct(found["eta_error_median"])]  # fmt: skip
            # One table row at a time, as it comes: a long run's partial results survive.
            table = markdown_table(headers, [row]).splitlines()
            print("\n".join(table if len(results) == 1 else table[2:]), flush=True)
    save_results(args.out, env_info, results, args)


if __name__ == "__main__":
    main()
