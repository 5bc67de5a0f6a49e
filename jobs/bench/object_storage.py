"""Jobs on object storage (BENCHMARKS.md "Object storage"): equality, kill -9 trials, throughput.

    python -m jobs.bench.object_storage --trials 20 --rows 256

Against a local S3 server (moto, tests/storage_servers.py) and, with --gcs, the GCS emulator:
1. The same job (the tiny random model, greedy, ignore_eos) from local disk to local disk and
   from s3:// to s3://: completions.parquet byte for byte, and each _SUCCESS manifest checked
   against the bytes it lists (sha256 and size computed here, from the server's copy).
2. `--trials` kill -9 trials of the s3 -> s3 job, aimed in turn at: the main process mid-
   generation, the moment a shard appears (a shard write), between the last shard and the
   manifest (completions.parquet written, _SUCCESS not yet) and during the final upload (a
   multipart upload of completions.parquet in flight). Each is rerun until it ends (the killed
   run's lease expires after storage.lease_seconds); then rows lost, duplicated or different
   against the clean run, objects under the prefix that do not parse, multipart uploads left,
   and the rows the rerun generated against the rows the killed run had not saved.
3. Throughput: `--repeats` alternating runs of the same job local -> local and s3 -> s3, the
   job's own generation rate (run.json) and the wall time of the whole command.
Each row carries a column of incompressible padding (`--pad-bytes`), so completions.parquet is
big enough to go up as a multipart upload. Markdown tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.bench.random_models import random_model_folder
from jobs.bench.report import command_line, cpu_model, log, markdown_table, parser
from tests.storage_servers import GCSServer, S3Server, StorageServer

ROOT = Path(__file__).resolve().parents[2]
FINAL = "completions.parquet"
SUCCESS = "_SUCCESS"
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]
AIMS = ("generation", "shard write", "shard -> manifest", "final upload")
LEASE_S = 5


def write_dataset(path: Path, rows: int, pad_bytes: int, seed: int) -> Path:
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "to", "write"]
    with open(path, "w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choices(words, k=rng.randint(4, 16)))
            pad = rng.randbytes(pad_bytes // 2).hex() if pad_bytes else ""
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt, "pad": pad}) + "\n")
    return path


def job_args(model: Path, data: str, out: str, max_tokens: int, small: bool = True) -> list[str]:
    """`small`: small windows and shards, so a kill always finds work in flight and shards being
    written; else the job's defaults (the throughput runs)."""
    sizes = ["dataset.window_rows=16", "flush_rows=8"] if small else []
    return [
        f"dataset.path={data}", f"model.path={model}", f"output_dir={out}", *sizes,
        f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true", "progress=false",
        f"storage.lease_seconds={LEASE_S}",
    ]  # fmt: skip


def start(args: list[str], env: dict[str, str], cwd: Path, log_file: Path) -> subprocess.Popen:
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}"]
    with open(log_file, "w") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.DEVNULL, stderr=err)


def run_to_end(
    args: list[str], env: dict[str, str], cwd: Path, log_file: Path, patience_s: float = 600
) -> tuple[int, int]:
    """Run until it ends with something other than "in use" (a dead run's lease not yet
    expired); (exit code, how many times it found the folder in use)."""
    waits = 0
    deadline = time.monotonic() + patience_s
    while True:
        proc = start(args, env, cwd, log_file)
        proc.wait()
        said = log_file.read_text()
        if proc.returncode == 2 and "in use" in said and time.monotonic() < deadline:
            waits += 1
            time.sleep(1.0)
            continue
        return proc.returncode, waits


# --- reading what a run left -------------------------------------------------------------------


def rows_of(data: bytes) -> list[dict]:
    return pq.read_table(io.BytesIO(data), columns=COMPARED).to_pylist()


@dataclass(frozen=True)
class Check:
    rows: int
    lost: int
    duplicated: int
    different: int
    unreadable: int  # objects under the prefix that a reader of their kind cannot parse
    uploads_left: int  # multipart uploads not completed nor aborted
    manifest_ok: bool


def check_output(server: S3Server, bucket: str, prefix: str, clean: list[dict]) -> Check:
    url = server.url(bucket, prefix)
    keys = server.keys(url)
    unreadable = 0
    for key in keys:
        data = server.read(key)
        try:
            if key.endswith(".parquet"):
                pq.read_metadata(io.BytesIO(data))
            elif key.endswith(".json") or key.endswith(SUCCESS):
                json.loads(data)
        except (pa.ArrowException, ValueError):
            unreadable += 1
    want = {r["id"]: r for r in clean}
    final = f"{url}/{FINAL}"
    got = rows_of(server.read(final)) if final in keys else []
    ids = [r["id"] for r in got]
    return Check(
        len(got),
        len(set(want) - set(ids)),
        len(ids) - len(set(ids)),
        sum(1 for r in got if r != want.get(r["id"])),
        unreadable,
        len(server.pending_uploads(bucket)),
        manifest_matches(server, url, keys),
    )


def manifest_matches(server: StorageServer, url: str, keys: list[str]) -> bool:
    """Whether _SUCCESS exists and every file it lists has the listed size and sha256 (both
    computed here from the server's bytes, not by batchpage)."""
    if f"{url}/{SUCCESS}" not in keys:
        return False
    manifest = json.loads(server.read(f"{url}/{SUCCESS}"))
    for entry in manifest["files"]:
        data = server.read(f"{url}/{entry['name']}")
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            return False
    return True


# --- kill -9 trials ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    aimed_at: str
    landed: str
    at_s: float
    exit: int
    unsaved: int  # rows the killed run had not saved in a shard
    rerun_generated: int  # rows the rerun found not done
    waits: int  # reruns refused while the dead run's lease lived
    check: Check


def _wait_for(proc: subprocess.Popen, ready: Callable[[], bool], poll_s: float = 0.005) -> None:
    while proc.poll() is None and not ready():
        time.sleep(poll_s)


def kill_trial(
    server: S3Server, model: Path, data: str, bucket: str, prefix: str, aim: str,
    clean: list[dict], workdir: Path, rng: random.Random, max_tokens: int,
) -> Trial:  # fmt: skip
    url = server.url(bucket, prefix)
    args = job_args(model, data, url, max_tokens)
    env = server.env
    proc = start(args, env, workdir, workdir / f"{prefix}.kill.log")
    started = time.monotonic()

    def shards() -> list[str]:
        return [k for k in server.keys(f"{url}/.batchpage/") if "/shard-" in k]

    def exists(name: str) -> bool:
        return f"{url}/{name}" in server.keys(f"{url}/")

    if aim == "generation":
        _wait_for(proc, lambda: bool(shards()), 0.05)
        time.sleep(rng.uniform(0.0, 1.5))
    elif aim == "shard write":
        _wait_for(proc, lambda: len(shards()) >= 2, 0.02)
        before = len(shards())
        _wait_for(proc, lambda: len(shards()) > before, 0.002)
    elif aim == "shard -> manifest":
        _wait_for(proc, lambda: exists(FINAL), 0.002)
    else:
        _wait_for(proc, lambda: any(k.endswith(FINAL) for k in server.pending_uploads(bucket)),
                  0.002)  # fmt: skip
    at = time.monotonic() - started
    landed = _phase(server, url) if proc.poll() is None else "ended first"
    saved = _saved_rows(server, url)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        landed = "ended first"
    total = len(clean)
    code, waits = run_to_end(args, env, workdir, workdir / f"{prefix}.log")
    if code != 0:
        raise RuntimeError(f"rerun failed: {(workdir / f'{prefix}.log').read_text()[-2000:]}")
    resumed = re.search(r"(\d+) rows already done", (workdir / f"{prefix}.log").read_text())
    generated = total - (int(resumed.group(1)) if resumed else 0)
    check = check_output(server, bucket, prefix, clean)
    return Trial(aim, landed, at, proc.returncode, total - saved, generated, waits, check)


def _saved_rows(server: S3Server, url: str) -> int:
    rows = 0
    for key in server.keys(f"{url}/.batchpage/"):
        if "/shard-" in key and key.endswith(".parquet"):
            rows += pq.read_metadata(io.BytesIO(server.read(key))).num_rows
    return rows


def _phase(server: S3Server, url: str) -> str:
    keys = server.keys(f"{url}/")
    if f"{url}/{SUCCESS}" in keys:
        return "after the commit"
    if f"{url}/{FINAL}" in keys:
        return "shard -> manifest"
    if any(k.endswith(FINAL) for k in server.pending_uploads(url.split("/")[2])):
        return "final upload"
    return "generation" if any("/shard-" in k for k in keys) else "load"


def trial_table(trials: list[Trial]) -> str:
    rows = [
        [i + 1, t.aimed_at, t.landed, f"{t.at_s:.2f}", t.exit, t.unsaved, t.rerun_generated,
         t.waits, t.check.rows, t.check.lost, t.check.duplicated, t.check.different,
         t.check.unreadable, t.check.uploads_left, "yes" if t.check.manifest_ok else "NO"]
        for i, t in enumerate(trials)
    ]  # fmt: skip
    killed = sum(t.exit == -signal.SIGKILL for t in trials)
    sums = [sum(r[k] for r in rows) for k in (9, 10, 11, 12, 13)]  # type: ignore[misc]
    over = sum(t.rerun_generated > t.unsaved for t in trials)
    rows.append(["all", "", f"{killed} killed", "", "", "", f"{over} over", "", "", *sums,
                 f"{sum(t.check.manifest_ok for t in trials)} ok"])  # fmt: skip
    headers = ["trial", "aimed at", "kill landed in", "after s", "exit", "rows unsaved",
               "rerun generated", "refused (lease)", "rows", "lost", "duplicated", "different",
               "unreadable objects", "uploads left", "_SUCCESS checks"]  # fmt: skip
    return markdown_table(headers, rows)


# --- throughput --------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__, smoke=False)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pad-bytes", type=int, default=160_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--throughput-rows", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gcs", action="store_true", help="also the equality run on the GCS emulator")
    p.add_argument("--only-throughput", action="store_true", help="skip equality and trials")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="object-storage-"))
    model = random_model_folder("tiny")
    print(f"command: `{command_line()}`  \nCPU: {cpu_model()}  \nmodel: tiny random\n")
    s3 = S3Server.start()
    servers: list[StorageServer] = [s3]
    try:
        data = write_dataset(workdir / "prompts.jsonl", args.rows, args.pad_bytes, args.seed)
        bucket = s3.new_bucket()
        s3.client().upload_file(str(data), bucket, "in/prompts.jsonl")
        s3_data = s3.url(bucket, "in", "prompts.jsonl")

        if not args.only_throughput:
            log("equality: local -> local, s3 -> s3")
            local_out = workdir / "local"
            code, _ = run_to_end(job_args(model, str(data), str(local_out), args.max_tokens), {},
                                 workdir, workdir / "local.log")  # fmt: skip
            assert code == 0, (workdir / "local.log").read_text()[-2000:]
            local_bytes = (local_out / FINAL).read_bytes()
            clean = rows_of(local_bytes)
            eq_rows = []
            targets = [(s3, bucket, s3_data)]
            if args.gcs:
                gcs = GCSServer.start()
                servers.append(gcs)
                gbucket = gcs.new_bucket()
                gcs.client().bucket(gbucket).blob("in/prompts.jsonl").upload_from_filename(
                    str(data)
                )
                targets.append((gcs, gbucket, gcs.url(gbucket, "in", "prompts.jsonl")))
            for server, bkt, src in targets:
                url = server.url(bkt, "equal")
                code, _ = run_to_end(job_args(model, src, url, args.max_tokens), server.env,
                                     workdir, workdir / f"{server.scheme}.log")  # fmt: skip
                assert code == 0, (workdir / f"{server.scheme}.log").read_text()[-2000:]
                remote = server.read(f"{url}/{FINAL}")
                keys = server.keys(url)
                same = "yes" if remote == local_bytes else "NO"
                checked = "yes" if manifest_matches(server, url, keys) else "NO"
                name = f"{server.scheme}:// -> {server.scheme}://"
                eq_rows.append([name, len(rows_of(remote)), same, len(local_bytes), checked])
            print(markdown_table(["job", "rows", "completions.parquet == local, byte for byte",
                                  "bytes", "_SUCCESS checks"], eq_rows), "\n")  # fmt: skip

            log(f"{args.trials} kill -9 trials, s3 -> s3")
            rng = random.Random(args.seed)
            trials = []
            for i in range(args.trials):
                aim = AIMS[i % len(AIMS)]
                trials.append(kill_trial(s3, model, s3_data, bucket, f"trial{i}", aim, clean,
                                         workdir, rng, args.max_tokens))  # fmt: skip
                log(f"trial {i + 1}/{args.trials}: {trials[-1]}")
            print(trial_table(trials), "\n")

        log("throughput: local and s3, alternating")
        tdata = write_dataset(workdir / "many.jsonl", args.throughput_rows, 0, args.seed + 1)
        s3.client().upload_file(str(tdata), bucket, "in/many.jsonl")
        walls: dict[str, list[float]] = {"local": [], "s3": []}
        rates: dict[str, list[float]] = {"local": [], "s3": []}
        gen: dict[str, list[float]] = {"local": [], "s3": []}
        for r in range(-1, args.repeats):  # run -1 warms both up (linear choices, kernels)
            for kind in ("local", "s3"):
                src = str(tdata) if kind == "local" else s3.url(bucket, "in", "many.jsonl")
                out = str(workdir / f"t{r + 1}") if kind == "local" else s3.url(bucket, f"t{r + 1}")
                env = {} if kind == "local" else s3.env
                started = time.perf_counter()
                code, _ = run_to_end(job_args(model, src, out, 4, small=False), env, workdir,
                                     workdir / f"t-{kind}{r}.log")  # fmt: skip
                wall = time.perf_counter() - started
                assert code == 0, (workdir / f"t-{kind}{r}.log").read_text()[-2000:]
                if r < 0:
                    continue
                walls[kind].append(wall)
                run = json.loads(Path(out, "run.json").read_text() if kind == "local"
                                 else s3.read(f"{out}/run.json"))  # fmt: skip
                rates[kind].append(args.throughput_rows / run["runs"][-1]["wall_s"])
                gen[kind].append(args.throughput_rows / run["runs"][-1]["metrics"]["elapsed_s"])
        med = {k: statistics.median(v) for k, v in walls.items()}
        rate = {k: statistics.median(v) for k, v in rates.items()}
        engine = {k: statistics.median(v) for k, v in gen.items()}
        n = args.throughput_rows
        table = [
            ["local -> local", n, f"{med['local']:.1f}", f"{rate['local']:.0f}",
             f"{engine['local']:.0f}"],
            ["s3 -> s3", n, f"{med['s3']:.1f}", f"{rate['s3']:.0f}", f"{engine['s3']:.0f}"],
            ["s3 / local", "", f"{med['local'] / med['s3']:.3f}x",
             f"{rate['s3'] / rate['local']:.3f}x", f"{engine['s3'] / engine['local']:.3f}x"],
        ]  # fmt: skip
        headers = ["job", "rows", "command wall s", "job rows/s (run.json wall_s)",
                   "generation rows/s (run.json elapsed_s)"]  # fmt: skip
        print(markdown_table(headers, table))
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
