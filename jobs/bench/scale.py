"""A million rows (BENCHMARKS.md "Scale"): the dry run and the job, from local disk and from S3.

    python -m jobs.bench.scale --rows 1000000 --what dry          # minutes
    python -m jobs.bench.scale --rows 1000000 --what job --source local   # ~ a quarter hour
    python -m jobs.bench.scale --rows 1000000 --what job --source s3

One-line prompts as JSON lines (`--rows` of them, and `--small-rows` for the flat-memory check),
the tiny random model, `--max-tokens` out each. The S3 side is moto's server on this machine
(tests/storage_servers.py): the input uploaded there, the output written there.
- dry: `dry_run=true` from local disk and from S3: wall time and peak RSS (of the process,
  from wait4).
- job: the job to the end: seconds to the first committed shard, rows/s over the run, peak RSS
  against a job of `--small-rows` rows with the same engine settings, and the ETA error: the
  `eta_s` of progress.json when 10% of the rows are done, against the time the job then took.
Each result is printed as it comes (markdown rows), so a long run's partial results survive.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.bench.random_models import random_model_folder
from jobs.bench.report import command_line, cpu_model, log, parser
from tests.storage_servers import S3Server

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = ["summarize", "the", "quick", "brown", "fox", "explain", "why", "a", "poem", "about"]
    with open(path, "w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choices(words, k=rng.randint(4, 16)))
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt}) + "\n")
    return path


@dataclass(frozen=True)
class Ran:
    code: int
    wall_s: float
    peak_rss_mb: float
    first_shard_s: float | None
    eta_error: float | None  # (eta at 10% - actual remaining) / actual remaining


def run(
    args: list[str],
    env: dict[str, str],
    workdir: Path,
    name: str,
    watch: Path | None = None,
    s3: S3Server | None = None,
    out_url: str = "",
) -> Ran:
    """Run the job command; with `watch` (a local output_dir) or `s3` + `out_url`, poll its
    shards and progress.json for the first shard and the ETA at 10%."""
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={workdir}"]
    with open(workdir / f"{name}.log", "w") as err:
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=full_env, stdout=subprocess.DEVNULL, stderr=err
        )
    started = time.monotonic()
    first = eta_at = at10 = None
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.monotonic() - started
        if watch is not None or s3 is not None:
            if first is None and _shards(watch, s3, out_url):
                first = now
            if eta_at is None:
                progress = _progress(watch, s3, out_url)
                total = progress.get("rows_total") or 0
                if total and progress.get("rows_done", 0) >= 0.1 * total and progress.get("eta_s"):
                    eta_at, at10 = progress["eta_s"], now
        time.sleep(0.5)
    wall = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    error = None if eta_at is None or at10 is None else (eta_at - (wall - at10)) / (wall - at10)
    return Ran(code, wall, usage.ru_maxrss / 1024, first, error)


def _shards(watch: Path | None, s3: S3Server | None, url: str) -> bool:
    if watch is not None:
        return any((watch / ".batchpage").glob("shard-*.parquet"))
    assert s3 is not None
    return any("/shard-" in k for k in s3.keys(f"{url}/.batchpage/"))


def _progress(watch: Path | None, s3: S3Server | None, url: str) -> dict:
    try:
        if watch is not None:
            return json.loads((watch / "progress.json").read_text())
        assert s3 is not None
        return json.loads(s3.read(f"{url}/progress.json"))
    except Exception:  # noqa: BLE001 (not written yet: OSError here, botocore's error there)
        return {}


def main() -> None:
    p = parser(__doc__, smoke=False)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--small-rows", type=int, default=10_000)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--what", choices=("dry", "job", "all"), default="all")
    p.add_argument("--source", choices=("local", "s3", "both"), default="both")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument(
        "--kv-cache-memory", type=int, default=None,
        help="engine.kv_cache_memory in bytes: a pool both jobs fill, so the RSS comparison is "
        "of what grows with rows (the default pool is touched only as far as a job fills it)",
    )  # fmt: skip
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = random_model_folder("tiny")
    print(f"command: `{command_line()}`  \nCPU: {cpu_model()}  \nmodel: tiny random, "
          f"{args.max_tokens} tokens out, KV pool "
          f"{args.kv_cache_memory or 'default'} bytes\n", flush=True)  # fmt: skip
    big = workdir / "big.jsonl"
    if not big.exists():
        log(f"writing {args.rows:,} prompts")
        write_prompts(big, args.rows)
    small = write_prompts(workdir / "small.jsonl", args.small_rows, seed=1)
    sources = ("local", "s3") if args.source == "both" else (args.source,)
    s3 = S3Server.start() if "s3" in sources else None
    try:
        bucket = ""
        if s3 is not None:
            bucket = s3.new_bucket()
            s3.client().upload_file(str(big), bucket, "in/big.jsonl")
            s3.client().upload_file(str(small), bucket, "in/small.jsonl")
        common = [f"model.path={model}", f"sampling.max_tokens={args.max_tokens}",
                  "sampling.ignore_eos=true", "progress=false"]  # fmt: skip
        if args.kv_cache_memory:
            common.append(f"engine.kv_cache_memory={args.kv_cache_memory}")
        print(
            "| what | source | rows | exit | wall s | peak RSS MB | first shard s | rows/s | "
            "ETA error at 10% | load (1 min) |\n|---|---|---|---|---|---|---|---|---|---|",
            flush=True,
        )
        for source in sources:
            env = s3.env if source == "s3" and s3 is not None else {}

            def data(file: str, source: str = source) -> str:
                if source == "local" or s3 is None:
                    return str(workdir / file)
                return s3.url(bucket, "in", file)

            if args.what in ("dry", "all"):
                log(f"dry run, {source}")
                ran = run([*common, f"dataset.path={data('big.jsonl')}", "dry_run=true"], env,
                          workdir, f"dry-{source}")  # fmt: skip
                _row("dry run", source, args.rows, ran)
            if args.what in ("job", "all"):
                for rows, file in ((args.small_rows, "small.jsonl"), (args.rows, "big.jsonl")):
                    log(f"job, {source}, {rows:,} rows")
                    name = f"job-{source}-{rows}"
                    local = source == "local" or s3 is None
                    out = str(workdir / name) if local else s3.url(bucket, name)
                    ran = run([*common, f"dataset.path={data(file)}", f"output_dir={out}"], env,
                              workdir, name, watch=Path(out) if source == "local" else None,
                              s3=s3 if source == "s3" else None, out_url=out)  # fmt: skip
                    _row("job", source, rows, ran)
    finally:
        if s3 is not None:
            s3.stop()


def _row(what: str, source: str, rows: int, ran: Ran) -> None:
    first = "" if ran.first_shard_s is None else f"{ran.first_shard_s:.1f}"
    rate = f"{rows / ran.wall_s:,.0f}" if what == "job" else ""
    eta = "" if ran.eta_error is None else f"{ran.eta_error:+.1%}"
    print(f"| {what} | {source} | {rows:,} | {ran.code} | {ran.wall_s:.1f} | "
          f"{ran.peak_rss_mb:,.0f} | {first} | {rate} | {eta} | {os.getloadavg()[0]:.1f} |",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
