"""The reliability tables of BENCHMARKS.md: kill -9 trials, bad inputs and GGUF fuzzing.

    python -m jobs.bench.reliability --trials 9 --rows 4 --max-tokens 8 --fuzz 3000

1. A clean run of the job (`--model`, the first `--rows` prompts of `--dataset`, greedy).
2. `--trials` times: the same job into a fresh folder, SIGKILL at a random moment of load,
   generation or the final merge in turn, rerun to the end, and compare completions.parquet
   with the clean run's: rows lost, duplicated or different, temporary files left.
3. Bad inputs a careless or hostile user gives the job, each run once through the command line
   (`--jobs` of them at once, each in its own folder): its exit code and the first line of what
   it said (for a row error: that row's error).
4. `--fuzz` mutated GGUF files loaded (jobs/gguf_fuzz.py): how each ended. A crash (an error
   that is not batchpage's own one-line refusal) is counted, not raised.
5. With `--signals`: SIGINT and SIGTERM sent mid-generation to a job over 2 tensor-parallel
   ranks and to one over 2 Ray replicas (the tiny random model): exit code, seconds from the
   signal to the exit, processes left behind, and the rerun's rows against a clean run's.
Markdown tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.numpy import save_file

from batchpage.output import work_dir
from jobs.bench.random_models import random_model_folder
from jobs.bench.report import command_line, cpu_model, log, markdown_table, parser
from jobs.gguf_fuzz import load_outcome, mutate, random_mutations, tiny_gguf
from tests.executor.cluster_nodes import descendants, running

ROOT = Path(__file__).resolve().parents[2]
FINAL = "completions.parquet"
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]
PHASES = ("load", "generation", "merge")


# --- the job -----------------------------------------------------------------------------------


def start_job(args: list[str], cwd: Path, log_file: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}"]
    with open(log_file, "w") as err:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err,
            preexec_fn=_sigint_by_default,
        )  # fmt: skip


def _sigint_by_default() -> None:
    """The job takes Ctrl-C as when started from a terminal, also where this benchmark runs in
    the background of a shell (which hands its children SIGINT ignored, and Python keeps that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def shards(out: Path) -> int:
    return len(list(work_dir(out).glob("shard-*.parquet")))


def merging(out: Path) -> bool:
    return any(out.glob(f".{FINAL}.*.tmp"))


@dataclass(frozen=True)
class Comparison:
    rows: int
    lost: int
    duplicated: int
    different: int

    def __str__(self) -> str:
        return (
            f"{self.rows} rows, {self.lost} lost, {self.duplicated} dup., {self.different} differ"
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


# --- kill -9 trials ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Timeline:
    """When a clean run wrote its first shard, its final file, and ended (s from start)."""

    first_shard: float
    final: float
    end: float


@dataclass(frozen=True)
class Trial:
    aimed_at: str
    landed: str  # the phase the kill found the job in, or "ended first"
    at_s: float
    first_exit: int  # of the run that was to be killed: -9 when the kill landed
    shards_left: int
    rerun_exit: int
    result: Comparison
    temps_left: int  # temporary files in the folder after the rerun (a kill's leftovers)


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


def _sleep_while(proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _phase(out: Path) -> str:
    if merging(out) or (out / FINAL).exists():
        return "merge"
    return "generation" if shards(out) else "load"


def kill_table(trials: list[Trial]) -> str:
    """One row per trial, then the totals. "exit" is the killed run's: -9 when the kill landed."""
    rows: list[list[object]] = [
        [i + 1, t.aimed_at, t.landed, f"{t.at_s:.2f}", t.first_exit, t.shards_left]
        + [t.rerun_exit, t.result.rows, t.result.lost, t.result.duplicated, t.result.different]
        + [t.temps_left]
        for i, t in enumerate(trials)
    ]
    killed = sum(t.first_exit == -signal.SIGKILL for t in trials)
    failed = sum(t.rerun_exit != 0 for t in trials)
    sums = [sum(r[k] for r in rows) for k in range(7, 12)]  # type: ignore[misc]
    rows.append(["all", "", f"{killed} killed", "", "", "", f"{failed} failed", *sums])
    headers = ["trial", "aimed at", "kill landed in", "after s", "exit", "shards kept"]
    more = ["rerun exit", "rows", "lost", "duplicated", "different", "temp files left"]
    return markdown_table([*headers, *more], rows)


# --- bad inputs --------------------------------------------------------------------------------


def _write(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


def _nested(levels: int) -> str:
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)


def _adapter(folder: Path, value: float = 0.01, **config: object) -> str:
    """A PEFT LoRA folder, rank 4 on layer 0's q_proj, one weight `value`, `config` over its
    adapter_config.json. Any model's job refuses it the same: model.loras are checked before
    the model loads, without fitting their shapes to it."""
    folder.mkdir(exist_ok=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    a, b = np.full((4, 64), 0.01, np.float32), np.full((64, 4), 0.01, np.float32)
    b[0, 0] = value
    save_file({key.format("A"): a, key.format("B"): b}, str(folder / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps({**fields, **config}))
    return str(folder)


def simple_cases(w: Path) -> list[tuple[str, list[str], bool]]:
    """(label, the job's extra overrides, whether the case brings its own dataset) of the inputs
    that are run once; their files are written into the folder `w` first."""
    add = '{"prompt": "def add(a, b):"}'
    two_prompts = w / "two_prompts.parquet"
    pq.write_table(
        pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], ["prompt"] * 2), two_prompts
    )
    (w / "long.csv").write_text("prompt\nshort\n" + "w" * 5000 + "\nlast\n")
    (w / "taken").write_text("a file")
    (w / "hostile.jinja").write_text("{% set s = namespace(x='x') %}{% for i in range(60) %}"
                                     "{% set s.x = s.x ~ s.x %}{% endfor %}{{ s.x }}")  # fmt: skip
    (w / "raises.jinja").write_text('{{ raise_exception("one system turn first") }}')
    own_folder = w / "own_folder"
    own_folder.mkdir(exist_ok=True)
    _write(own_folder / "a.jsonl", add)
    truncated = tiny_gguf(w / "truncated.gguf")
    truncated.write_bytes(truncated.read_bytes()[:1500])  # inside the vocabulary
    row_schema = '{"type": "json_schema", "json_schema": {"schema": ' + _nested(1000) + "}}"

    def data(name: str, *lines: str | bytes) -> str:
        return f"dataset.path={_write(w / name, *lines)}"

    def gguf(name: str, edits: dict[str, int]) -> list[str]:
        return [f"model.path={tiny_gguf(w / name, edits)}"]

    lora = ["dataset.lora_column=adapter", "engine.enable_lora=true",
            data("lora.jsonl", json.dumps({"prompt": "x", "adapter": "b"}))]  # fmt: skip
    adapter_ok = _adapter(w / "adapter_ok")

    def loras(name: str, value: float = 0.01, **config: object) -> list[str]:
        return [*lora, f"model.loras={{a: {adapter_ok}, b: {_adapter(w / name, value, **config)}}}"]

    return [
        ("invalid UTF-8 in one JSONL line",
         [data("utf8.jsonl", add, b'{"prompt": "caf\xe9 \xff"}', '{"prompt": "x = 1"}')], True),
        ("duplicate ids (dataset.id_column=id)", ["dataset.id_column=id", data("dup.jsonl", *(
            json.dumps({"id": i, "prompt": f"p{n}"}) for n, i in enumerate("abab")))], True),
        ("output_dir is a file", [f"output_dir={w / 'taken'}"], False),
        ("unknown Hydra key (sampling.temprature)", ["sampling.temprature=0.5"], False),
        ("wrong type (engine.block_size=big)", ["engine.block_size=big"], False),
        ("GGUF cut inside its header", [f"model.path={truncated}"], False),
        ("GGUF with a 4e9 vocab_size", gguf("vocab.gguf", {"vocab_size": 4_000_000_000}), False),
        ("GGUF with head_count 0", gguf("heads.gguf", {"attention__head_count": 0}), False),
        ("GGUF with block_count 2^31-1", gguf("blocks.gguf", {"block_count": 2**31 - 1}), False),
        ("score=humaneval on dataset=demo", ["dataset=demo", "score=humaneval"], True),
        ('a lone surrogate ("\\ud800") in a prompt',
         [data("surrogate.jsonl", add, r'{"prompt": "x \ud800 y"}', '{"prompt": "x = 1"}')], True),
        ("dataset.path=/dev/zero", ["dataset.path=/dev/zero", "dataset.format=jsonl"], True),
        ("a 10 MB JSONL line",
         [data("oversize.jsonl", add, json.dumps({"prompt": "word " * 2_000_000}))], True),
        ("a chat template doubling a string 60 times",
         [f"engine.chat_template={w / 'hostile.jinja'}"], False),
        ("a comma in dataset.path, unquoted", [data("a,b.jsonl", add)], True),
        ("a JSON schema on the command line, unquoted",
         ['sampling.structured_outputs.json={"type": "object"}'], False),
        ("sampling.structured_outputs.json nested 1,000 levels",
         [f"sampling.structured_outputs.json='{_nested(1000)}'"], False),
        ("a row's response_format nested 1,000 levels",
         [data("deeprow.jsonl", add, f'{{"prompt": "x", "response_format": {row_schema}}}')], True),
        ("a Parquet file with two prompt columns", [f"dataset.path={two_prompts}"], True),
        ("a CSV record 5x dataset.max_prompt_bytes",
         [f"dataset.path={w / 'long.csv'}", "dataset.max_prompt_bytes=1000"], True),
        ("an embed job with one empty prompt",
         ["engine.task=embed", data("embed.jsonl", add, '{"prompt": ""}')], True),
        ("sampling.thinking_token_budget, no reasoning parser",
         ["sampling.thinking_token_budget=8"], False),
        ("sampling.stop_token_ids outside the vocabulary",
         ["sampling.stop_token_ids=[1,99999999]"], False),
        ("a job-wide regex that does not compile",
         ["sampling.structured_outputs.regex='(ab'", "sampling.ignore_eos=false"], False),
        ("a chat template that raises on a one-line chat",
         [f"engine.chat_template={w / 'raises.jinja'}", "dataset.chat_template=true"], False),
        ("flush_rows=0", ["flush_rows=0"], False),
        ("flush_seconds=-1", ["flush_seconds=-1"], False),
        ("output_dir is the dataset's folder",
         [f"dataset.path={own_folder}", f"output_dir={own_folder}"], True),
        ("engine.tensor_parallel_size=64 on this CPU",
         ["engine.tensor_parallel_size=64", "engine.quantized_weights=false"], False),
        ("invalid UTF-8 in one JSONL line, with an id column",
         [data("utf8_ids.jsonl", '{"id": "a", "prompt": "x"}', b'{"id": "b", "prompt": "\xff"}')],
         True),
        ("a misspelled key added with + (+sampling.max_tokenz=3)", ["+sampling.max_tokenz=3"],
         False),
        ("dry_run=true, no output_dir, run from the input's folder",
         ["dry_run=true", "output_dir=null", data("dry.jsonl", add)], True),
        ("engine.batch_invariant=true, engine.linear_backend=torch",
         ["engine.batch_invariant=true", "engine.linear_backend=torch"], False),
        ("model.loras={a: ..., b: ...}, b's weights NaN", loras("nan", float("nan")), True),
        ("model.loras={a: ..., b: ...}, b's weights infinite", loras("inf", float("inf")), True),
        ("a LoRA adapter_config.json with r=8, tensors of rank 4", loras("rank", r=8), True),
        ("a LoRA adapter_config.json targeting modules the model lacks",
         loras("targets", target_modules=["qkv"]), True),
    ]  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    case: str
    exit_code: int
    message: str
    rows_as_clean: str  # for the cases that finish: do the rows match the clean run's?


def run_cases(job: list[str], clean: Path, w: Path, jobs: int = 1) -> list[Outcome]:
    """`job`: the clean run's overrides (without output_dir); `clean`: its output folder. The
    simple cases, each a job of its own folder, run `jobs` at a time."""
    outcomes = []
    own = [a for a in job if not a.startswith(("dataset=", "dataset.limit="))]  # a case's data

    def one(i: int, label: str, extra: list[str], own_data: bool) -> Outcome:
        out = w / f"case{i}_out"
        keys = {a.partition("=")[0] for a in extra}  # the case's value of a key replaces the job's
        base = [a for a in (own if own_data else job) if a.partition("=")[0] not in keys]
        dest = [] if any(a.startswith("output_dir=") for a in extra) else [f"output_dir={out}"]
        code, said, _ = _run(f"case{i}", [*base, *extra, *dest], w)
        if code == 0 and (out / FINAL).exists():  # the bad row's error is the message
            errors = pq.read_table(out / FINAL, columns=["error"])["error"].to_pylist()
            said = next((e for e in errors if e), "(no row error)")
        return Outcome(label, code, said, "-")

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes += pool.map(lambda c: one(c[0], *c[1]), enumerate(simple_cases(w)))
    for special in (_damaged_shard, _damaged_job_json, _disk_full):
        outcomes.append(special(job, clean, w))
    outcomes.append(_late_jsonl_column(own, w))
    outcomes.append(_changing_input("cut", "input truncated mid-run", own, w, _cut))
    outcomes.append(
        _changing_input("rewrite", "input rewritten in place mid-run", own, w, _rewrite)
    )
    return [Outcome(o.case, o.exit_code, _short(o.message, w), o.rows_as_clean) for o in outcomes]


def _run(case: str, args: list[str], workdir: Path) -> tuple[int, str, str]:
    """Exit code, the first line that says what is wrong, and the whole stderr."""
    log_file = workdir / f"{case}.log"
    proc = start_job(args, workdir, log_file)
    proc.wait()
    text = log_file.read_text(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    return proc.returncode, said, text


def _short(said: str, workdir: Path) -> str:
    return said.replace(str(workdir) + "/", "")[:200]


def _damaged_shard(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """The clean output with garbage in its first shard, run again."""
    out = workdir / "damaged_out"
    shutil.copytree(clean, out)
    next(iter(sorted(work_dir(out).glob("shard-*.parquet")))).write_bytes(b"garbage")
    code, _, text = _run("damaged", [*job, f"output_dir={out}"], workdir)
    said = next((line.strip() for line in text.splitlines() if "unreadable shard" in line), "")
    said = said[said.find("unreadable") :]
    return Outcome("damaged shard (garbage bytes), rerun", code, said, str(compare(clean, out)))


def _damaged_job_json(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """The clean output with its job.json cut short, run again, then with overwrite=true."""
    out = workdir / "jobjson_out"
    shutil.copytree(clean, out)
    job_file = work_dir(out) / "job.json"
    job_file.write_text(job_file.read_text()[:40])
    code, said, _ = _run("jobjson", [*job, f"output_dir={out}"], workdir)
    again, _, _ = _run("jobjson2", [*job, f"output_dir={out}", "overwrite=true"], workdir)
    rows = str(compare(clean, out)) if again == 0 else f"overwrite rerun exit {again}"
    return Outcome("damaged job.json, rerun (then overwrite=true)", code, said, rows)


def _disk_full(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """output_dir on a 48 KiB tmpfs (needs root to mount); then the folder is copied to a
    roomy disk and the job rerun there: does it resume to the clean rows?"""
    small = workdir / "tmpfs"
    small.mkdir(exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(small)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        return Outcome("disk full (48 KiB tmpfs)", -1, "skipped: cannot mount a tmpfs", "-")
    try:
        code, said, _ = _run("full", [*job, f"output_dir={small / 'out'}"], workdir)
        moved = workdir / "full_out"
        shutil.copytree(small / "out", moved)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
    again, _, _ = _run("full2", [*job, f"output_dir={moved}"], workdir)
    rows = str(compare(clean, moved)) if again == 0 else f"rerun exit {again}"
    return Outcome("disk full (48 KiB tmpfs), rerun elsewhere", code, said, rows)


def _late_jsonl_column(job: list[str], workdir: Path) -> Outcome:
    """A JSONL whose column `late` first appears on line 1,200 (of 1,200), the job limited to
    its first rows: is the column in completions.parquet?"""
    lines = [json.dumps({"prompt": f"def f{i}(x):"}) for i in range(1199)]
    data = _write(workdir / "late.jsonl", *lines, json.dumps({"prompt": "x", "late": "here"}))
    out = workdir / "late_out"
    args = [*job, f"dataset.path={data}", "dataset.limit=3", f"output_dir={out}"]
    code, said, _ = _run("late", args, workdir)
    if code == 0:
        names = pq.read_schema(out / FINAL).names
        said = f"column 'late' {'carried' if 'late' in names else 'dropped'}"
    return Outcome("a JSONL column first seen on line 1,200", code, said, "-")


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _rewrite(path: Path) -> None:
    text = path.read_text()
    with open(path, "r+") as f:
        f.write(text.replace("def f", "def g"))


def _changing_input(
    case: str, label: str, job: list[str], workdir: Path, change: Callable[[Path], None]
) -> Outcome:
    """A JSONL of 16 prompts changed by `change` once the job wrote its first shard."""
    data = _write(
        workdir / f"{case}.jsonl", *(json.dumps({"prompt": f"def f{i}(x):"}) for i in range(16))
    )
    out = workdir / f"{case}_out"
    proc = start_job(
        [*job, f"dataset.path={data}", f"output_dir={out}"], workdir, workdir / f"{case}.log"
    )
    while proc.poll() is None and not shards(out):
        time.sleep(0.01)
    changed = proc.poll() is None
    if changed:
        change(data)
    proc.wait()
    lines = [
        line.strip() for line in (workdir / f"{case}.log").read_text(errors="replace").splitlines()
    ]
    said = next((line for line in lines if line.startswith("error:")), "(no error)")
    said = said if changed else "(the job ended before the change)"
    kept = {
        i
        for s in work_dir(out).glob("shard-*.parquet")
        for i in pq.read_table(s)["index"].to_pylist()
    }
    return Outcome(label, proc.returncode, said, f"{len(kept)} rows kept")


# --- signals -----------------------------------------------------------------------------------

SIGNAL_PATIENCE_S = 60.0  # past this a signalled job counts as hung: it and its processes killed
SIGNAL_GONE_S = 10.0  # after its exit, for the processes it started (Ray's) to end


@dataclass(frozen=True)
class Stopped:
    case: str
    exit_code: int
    seconds: float  # from the signal to the exit
    left: int  # of the processes the job had started (workers, Ray's), still running after it
    started: int
    message: str
    rows: str  # the rerun's rows against the clean run's


def signal_cases(workdir: Path) -> list[Stopped]:
    """SIGINT and SIGTERM sent mid-generation to the driver of a job over two tensor-parallel
    ranks and to one over two Ray replicas (skipped without Ray), on the tiny random model
    (jobs.bench.random_models, which splits over 2 ranks), each compared with a clean run."""
    prompts = (json.dumps({"prompt": f"def f{i}(x):"}) for i in range(256))
    base = [
        f"dataset.path={_write(workdir / 'signals.jsonl', *prompts)}",
        f"model.path={random_model_folder('tiny')}", "engine.dtype=float32",
        "dataset.window_rows=16", "sampling.max_tokens=128", "sampling.ignore_eos=true",
        "flush_rows=1", "progress=false",
    ]  # fmt: skip
    clean = workdir / "signals_clean"
    code, said, _ = _run("signals_clean", [*base, f"output_dir={clean}"], workdir)
    if code != 0:
        raise RuntimeError(f"the signals' clean run failed (exit {code}): {said}")
    setups = [("2 tensor-parallel ranks", ["engine.tensor_parallel_size=2"])]
    if importlib.util.find_spec("ray") is not None:
        setups.append(("executor=ray, 2 replicas", ["executor=ray", "executor.num_replicas=2"]))
    runs = [
        (sig, label, extra) for label, extra in setups for sig in (signal.SIGINT, signal.SIGTERM)
    ]
    return [
        _signalled(sig, label, [*base, *extra], clean, workdir / f"signal{i}")
        for i, (sig, label, extra) in enumerate(runs)
    ]


def _signalled(sig: int, label: str, job: list[str], clean: Path, out: Path) -> Stopped:
    """`job` sent `sig` once its first shard is written: how it ended, then the rerun's rows
    against the clean run's."""
    case = f"{signal.Signals(sig).name} mid-generation, {label}"
    log_file = out.parent / f"{out.name}.log"
    proc = start_job([*job, f"output_dir={out}"], out.parent, log_file)
    while proc.poll() is None and not shards(out):
        time.sleep(0.01)
    if proc.poll() is not None:
        return Stopped(case, proc.returncode, 0.0, 0, 0, "(the job ended before the signal)", "-")
    started = descendants(proc.pid)
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=SIGNAL_PATIENCE_S)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *running(descendants(proc.pid))]:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - sent
    gone_by = time.monotonic() + SIGNAL_GONE_S
    while running(started) and time.monotonic() < gone_by:
        time.sleep(0.1)
    left = len(running(started))
    lines = log_file.read_text(errors="replace").splitlines()
    said = next((line for line in lines if "finished rows are saved" in line), "(no message)")
    said = _short(said, out.parent)
    again, _, _ = _run(f"{out.name}_rerun", [*job, f"output_dir={out}"], out.parent)
    rows = str(compare(clean, out)) if again == 0 else f"rerun exit {again}"
    return Stopped(case, proc.returncode, seconds, left, len(started), said, rows)


def signal_table(stopped: list[Stopped]) -> str:
    rows = [
        [s.case, s.exit_code, f"{s.seconds:.1f}", f"{s.left} of {s.started}",
         s.message.replace("|", "\\|"), s.rows]
        for s in stopped
    ]  # fmt: skip
    headers = ["signal", "exit", "exit after s", "processes left", "message", "rerun rows"]
    return markdown_table(headers, rows)


# --- GGUF fuzzing and the report ---------------------------------------------------------------


def fuzz(count: int, seed: int, workdir: Path) -> tuple[Counter[str], float]:
    """Outcomes of `count` mutated copies of the tiny GGUF, and the seconds it took."""
    valid = tiny_gguf(workdir / "fuzz_valid.gguf")
    load_outcome(valid)  # warm-up, outside the timing
    from batchpage.model.gguf_file import read_gguf_header

    data, header_bytes = valid.read_bytes(), read_gguf_header(valid).data_start
    rng, outcomes, path = random.Random(seed), Counter[str](), workdir / "fuzz.gguf"
    started = time.perf_counter()
    for _ in range(count):
        mutated = data
        for op, pos, value in random_mutations(rng, header_bytes):
            mutated = mutate(mutated, op, pos, value)
        path.write_bytes(mutated)
        try:
            outcomes[load_outcome(path)] += 1
        except Exception as e:  # noqa: BLE001 - a crash is what this counts
            outcomes[f"CRASH {type(e).__name__}"] += 1
    return outcomes, time.perf_counter() - started


def main() -> None:
    p = parser(__doc__, smoke=False)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dataset", default="evals")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--fuzz", type=int, default=3000, help="mutated GGUF files to load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="bad-input cases run at once")  # fmt: skip
    p.add_argument("--signals", action="store_true",
                   help="also SIGINT and SIGTERM mid-generation under 2 tensor-parallel ranks "
                   "and 2 Ray replicas (minutes)")  # fmt: skip
    p.add_argument("extra", nargs="*", help="more Hydra overrides for the job")
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="reliability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Small windows and a shard per finished row, so a kill always finds work in flight.
    job = [
        f"dataset={args.dataset}", f"dataset.limit={args.rows}", "dataset.window_rows=2",
        f"model.path={args.model}", f"sampling.max_tokens={args.max_tokens}",
        "sampling.ignore_eos=true", "flush_rows=1", "progress=false", *args.extra,
    ]  # fmt: skip
    print(f"command: `{command_line()}`  \nCPU: {cpu_model()}  \njob: `{' '.join(job)}`\n")

    log(f"clean run and {args.trials} kill trials in {workdir}")
    rng, clean = random.Random(args.seed), workdir / "clean"
    timeline = clean_run(job, clean, workdir)
    trials = []
    for i in range(args.trials):
        aim = PHASES[i % len(PHASES)]
        trials.append(kill_trial(job, clean, timeline, aim, workdir / f"trial{i}", rng))
        log(f"trial {i + 1}/{args.trials}: {trials[-1]}")
    print(f"clean run: first shard at {timeline.first_shard:.1f} s, completions.parquet at "
          f"{timeline.final:.1f} s, exit at {timeline.end:.1f} s\n")  # fmt: skip
    print(kill_table(trials), "\n")

    log("bad inputs")
    cases = run_cases(job, clean, workdir, args.jobs)
    rows = [(c.case, c.exit_code, c.message.replace("|", "\\|"), c.rows_as_clean) for c in cases]
    print(markdown_table(["input", "exit", "first line of the message", "rows"], rows), "\n")

    if args.signals:
        log("signals mid-generation")
        print(signal_table(signal_cases(workdir)), "\n")

    log(f"fuzzing {args.fuzz} GGUF files")
    outcomes, seconds = fuzz(args.fuzz, args.seed, workdir)
    print(f"{args.fuzz} mutated GGUF files in {seconds:.1f} s:\n")
    print(markdown_table(["outcome", "files"], sorted(outcomes.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
