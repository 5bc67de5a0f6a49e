"""Bad inputs a careless or hostile user gives the job, each run once through the command line:
its exit code and the first line of what it said (for a row error: that row's error)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.bench.kill_trials import FINAL, compare, start_job
from jobs.gguf_fuzz import tiny_gguf


@dataclass(frozen=True)
class Outcome:
    case: str
    exit_code: int
    message: str
    rows_as_clean: str  # for the cases that finish: do the rows match the clean run's?


def run_cases(job: list[str], clean: Path, workdir: Path) -> list[Outcome]:
    """`job`: the clean run's overrides (without output_dir); `clean`: its output folder."""
    cases: list[Callable[[list[str], Path, Path], Outcome]] = [
        _bad_utf8, _duplicate_ids, _output_dir_is_a_file, _unknown_key, _wrong_type,
        _gguf_truncated, _gguf_huge_vocab, _gguf_zero_heads, _gguf_huge_block_count,
        _damaged_shard, _damaged_job_json, _score_not_humaneval, _disk_full, _input_truncated,
        _input_rewritten, _lone_surrogate, _dev_zero, _oversize_line, _hostile_template,
        _comma_in_path, _unquoted_schema, _deep_schema, _deep_row_schema, _duplicate_column,
        _long_csv_record,
    ]  # fmt: skip
    return [case(job, clean, workdir) for case in cases]


def _run(case: str, args: list[str], workdir: Path) -> tuple[int, str, str]:
    """Exit code, the first line that says what is wrong, and the whole stderr."""
    log = workdir / f"{case}.log"
    proc = start_job(args, workdir, log)
    proc.wait()
    text = log.read_text(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    return proc.returncode, said, text


def _dataset(workdir: Path, name: str, lines: list[bytes]) -> Path:
    path = workdir / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _plain(job: list[str]) -> list[str]:
    """The job without its dataset choice, for cases that bring their own file."""
    return [a for a in job if not a.startswith(("dataset=", "dataset.limit="))]


def _bad_utf8(job: list[str], clean: Path, workdir: Path) -> Outcome:
    data = _dataset(
        workdir,
        "utf8.jsonl",
        [b'{"prompt": "def add(a, b):"}', b'{"prompt": "caf\xe9 \xff"}', b'{"prompt": "x = 1"}'],
    )
    out = workdir / "utf8_out"
    code, said, _ = _run(
        "utf8", [*_plain(job), f"dataset.path={data}", f"output_dir={out}"], workdir
    )
    if code == 0:
        errors = [
            e for e in pq.read_table(out / FINAL, columns=["error"])["error"].to_pylist() if e
        ]
        said = errors[0] if errors else "(no row error: the bad line was generated)"
    return Outcome("invalid UTF-8 in one JSONL line", code, said, "-")


def _duplicate_ids(job: list[str], clean: Path, workdir: Path) -> Outcome:
    rows = [json.dumps({"id": i, "prompt": f"p{n}"}).encode() for n, i in enumerate("abab")]
    data = _dataset(workdir, "dup.jsonl", rows)
    args = [*_plain(job), f"dataset.path={data}", "dataset.id_column=id"]
    code, said, _ = _run("dup", [*args, f"output_dir={workdir / 'dup_out'}"], workdir)
    return Outcome("duplicate ids (dataset.id_column=id)", code, said, "-")


def _output_dir_is_a_file(job: list[str], clean: Path, workdir: Path) -> Outcome:
    taken = workdir / "taken"
    taken.write_text("a file")
    code, said, _ = _run("taken", [*job, f"output_dir={taken}"], workdir)
    return Outcome("output_dir is a file", code, said, "-")


def _unknown_key(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*job, "sampling.temprature=0.5", f"output_dir={workdir / 'key_out'}"]
    code, said, _ = _run("key", args, workdir)
    return Outcome("unknown Hydra key (sampling.temprature)", code, said, "-")


def _wrong_type(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*job, "engine.block_size=big", f"output_dir={workdir / 'type_out'}"]
    code, said, _ = _run("type", args, workdir)
    return Outcome("wrong type (engine.block_size=big)", code, said, "-")


def _hostile_gguf(case: str, label: str, path: Path, job: list[str], workdir: Path) -> Outcome:
    args = [*job, f"model.path={path}", f"output_dir={workdir / (case + '_out')}"]
    code, said, _ = _run(case, args, workdir)
    return Outcome(label, code, said.replace(str(workdir) + "/", ""), "-")


def _gguf_truncated(job: list[str], clean: Path, workdir: Path) -> Outcome:
    path = tiny_gguf(workdir / "truncated.gguf")
    path.write_bytes(path.read_bytes()[:1500])  # inside the vocabulary
    return _hostile_gguf("trunc", "GGUF cut inside its header", path, job, workdir)


def _gguf_huge_vocab(job: list[str], clean: Path, workdir: Path) -> Outcome:
    path = tiny_gguf(workdir / "vocab.gguf", {"vocab_size": 4_000_000_000})
    return _hostile_gguf("vocab", "GGUF with a 4e9 vocab_size", path, job, workdir)


def _gguf_zero_heads(job: list[str], clean: Path, workdir: Path) -> Outcome:
    path = tiny_gguf(workdir / "heads.gguf", {"attention__head_count": 0})
    return _hostile_gguf("heads", "GGUF with head_count 0", path, job, workdir)


def _gguf_huge_block_count(job: list[str], clean: Path, workdir: Path) -> Outcome:
    path = tiny_gguf(workdir / "blocks.gguf", {"block_count": 2**31 - 1})
    return _hostile_gguf("blocks", "GGUF with block_count 2^31-1", path, job, workdir)


def _damaged_shard(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """The clean output with garbage in its first shard, run again."""
    out = workdir / "damaged_out"
    shutil.copytree(clean, out)
    next(iter(sorted(out.glob("shard-*.parquet")))).write_bytes(b"garbage")
    code, _, text = _run("damaged", [*job, f"output_dir={out}"], workdir)
    said = next((line.strip() for line in text.splitlines() if "unreadable shard" in line), "")
    said = said[said.find("unreadable") :].replace(str(workdir) + "/", "")
    c = compare(clean, out)
    same = f"{c.rows} rows, {c.lost} lost, {c.duplicated} dup., {c.different} differ"
    return Outcome("damaged shard (garbage bytes), rerun", code, said, same)


def _rows_kept(clean: Path, out: Path) -> str:
    c = compare(clean, out)
    return f"{c.rows} rows, {c.lost} lost, {c.duplicated} dup., {c.different} differ"


def _damaged_job_json(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """The clean output with its job.json cut short, run again, then with overwrite=true."""
    out = workdir / "jobjson_out"
    shutil.copytree(clean, out)
    (out / "job.json").write_text((out / "job.json").read_text()[:40])
    code, said, _ = _run("jobjson", [*job, f"output_dir={out}"], workdir)
    again, _, _ = _run("jobjson2", [*job, f"output_dir={out}", "overwrite=true"], workdir)
    rows = _rows_kept(clean, out) if again == 0 else f"overwrite rerun exit {again}"
    return Outcome(
        "damaged job.json, rerun (then overwrite=true)", code, _short(said, workdir), rows
    )


def _score_not_humaneval(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*_plain(job), "dataset=demo", "score=humaneval", f"output_dir={workdir / 'sc_out'}"]
    code, said, _ = _run("score", args, workdir)
    return Outcome("score=humaneval on dataset=demo", code, said, "-")


def _disk_full(job: list[str], clean: Path, workdir: Path) -> Outcome:
    """output_dir on a 48 KiB tmpfs (needs root to mount); then the folder is copied to a
    roomy disk and the job rerun there: does it resume to the clean rows?"""
    small = workdir / "tmpfs"
    small.mkdir(exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        return Outcome("disk full (48 KiB tmpfs)", -1, "skipped: cannot mount a tmpfs", "-")
    try:
        code, said, _ = _run("full", [*job, f"output_dir={small / 'out'}"], workdir)
        moved = workdir / "full_out"
        shutil.copytree(small / "out", moved)
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
    again, _, _ = _run("full2", [*job, f"output_dir={moved}"], workdir)
    rows = _rows_kept(clean, moved) if again == 0 else f"rerun exit {again}"
    return Outcome("disk full (48 KiB tmpfs), rerun elsewhere", code, _short(said, workdir), rows)


def _changing_input(
    case: str, label: str, job: list[str], workdir: Path, change: Callable[[Path], None]
) -> Outcome:
    """A JSONL of 16 prompts changed by `change` once the job wrote its first shard."""
    data = _dataset(
        workdir,
        f"{case}.jsonl",
        [json.dumps({"prompt": f"def f{i}(x):"}).encode() for i in range(16)],
    )
    out = workdir / f"{case}_out"
    args = [*_plain(job), f"dataset.path={data}", f"output_dir={out}"]
    log = workdir / f"{case}.log"
    proc = start_job(args, workdir, log)
    while proc.poll() is None and not list(out.glob("shard-*.parquet")):
        time.sleep(0.01)
    changed = proc.poll() is None
    if changed:
        change(data)
    proc.wait()
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    said = next((line for line in lines if line.startswith("error:")), "(no error)")
    said = said if changed else "(the job ended before the change)"
    kept = len(
        {i for s in out.glob("shard-*.parquet") for i in pq.read_table(s)["index"].to_pylist()}
    )
    return Outcome(label, proc.returncode, _short(said, workdir), f"{kept} rows kept")


def _input_truncated(job: list[str], clean: Path, workdir: Path) -> Outcome:
    def cut(path: Path) -> None:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return _changing_input("cut", "input truncated mid-run", job, workdir, cut)


def _input_rewritten(job: list[str], clean: Path, workdir: Path) -> Outcome:
    def rewrite(path: Path) -> None:
        text = path.read_text()
        with open(path, "r+") as f:
            f.write(text.replace("def f", "def g"))

    return _changing_input("rewrite", "input rewritten in place mid-run", job, workdir, rewrite)


def _row_error_case(
    case: str, label: str, lines: list[bytes], job: list[str], workdir: Path
) -> Outcome:
    data = _dataset(workdir, f"{case}.jsonl", lines)
    out = workdir / f"{case}_out"
    code, said, _ = _run(case, [*_plain(job), f"dataset.path={data}", f"output_dir={out}"], workdir)
    if code == 0:
        errors = [
            e for e in pq.read_table(out / FINAL, columns=["error"])["error"].to_pylist() if e
        ]
        said = errors[0][:160] if errors else "(no row error)"
    return Outcome(label, code, _short(said, workdir), "-")


def _lone_surrogate(job: list[str], clean: Path, workdir: Path) -> Outcome:
    lines = [b'{"prompt": "def add(a, b):"}', b'{"prompt": "x \\ud800 y"}', b'{"prompt": "x = 1"}']
    return _row_error_case(
        "surrogate", 'a lone surrogate ("\\ud800") in a prompt', lines, job, workdir
    )


def _oversize_line(job: list[str], clean: Path, workdir: Path) -> Outcome:
    big = json.dumps({"prompt": "word " * 2_000_000}).encode()  # a 10 MB line
    lines = [b'{"prompt": "def add(a, b):"}', big]
    return _row_error_case("oversize", "a 10 MB JSONL line", lines, job, workdir)


def _dev_zero(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*_plain(job), "dataset.path=/dev/zero", "dataset.format=jsonl"]
    code, said, _ = _run("devzero", [*args, f"output_dir={workdir / 'zero_out'}"], workdir)
    return Outcome("dataset.path=/dev/zero", code, said, "-")


def _hostile_template(job: list[str], clean: Path, workdir: Path) -> Outcome:
    template = workdir / "hostile.jinja"
    template.write_text("{% set s = namespace(x='x') %}{% for i in range(60) %}"
                        "{% set s.x = s.x ~ s.x %}{% endfor %}{{ s.x }}")  # fmt: skip
    args = [*job, f"engine.chat_template={template}", f"output_dir={workdir / 'tpl_out'}"]
    code, said, _ = _run("template", args, workdir)
    return Outcome("a chat template doubling a string 60 times", code, _short(said, workdir), "-")


def _short(said: str, workdir: Path) -> str:
    return said.replace(str(workdir) + "/", "")[:200]


def _comma_in_path(job: list[str], clean: Path, workdir: Path) -> Outcome:
    data = _dataset(workdir, "a,b.jsonl", [b'{"prompt": "def add(a, b):"}'])
    args = [*_plain(job), f"dataset.path={data}", f"output_dir={workdir / 'comma_out'}"]
    code, said, _ = _run("comma", args, workdir)
    return Outcome("a comma in dataset.path, unquoted", code, _short(said, workdir), "-")


def _unquoted_schema(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*job, 'sampling.structured_outputs.json={"type": "object"}']
    code, said, _ = _run("unquoted", [*args, f"output_dir={workdir / 'unquoted_out'}"], workdir)
    return Outcome("a JSON schema on the command line, unquoted", code, said, "-")


def _nested(levels: int) -> str:
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)


def _deep_schema(job: list[str], clean: Path, workdir: Path) -> Outcome:
    args = [*job, f"sampling.structured_outputs.json='{_nested(1000)}'"]
    code, said, _ = _run("deep", [*args, f"output_dir={workdir / 'deep_out'}"], workdir)
    return Outcome("sampling.structured_outputs.json nested 1,000 levels", code, said, "-")


def _deep_row_schema(job: list[str], clean: Path, workdir: Path) -> Outcome:
    schema = '{"type": "json_schema", "json_schema": {"schema": ' + _nested(1000) + "}}"
    lines = ['{"prompt": "def add(a, b):"}', f'{{"prompt": "x", "response_format": {schema}}}']
    label = "a row's response_format nested 1,000 levels"
    return _row_error_case("deeprow", label, [line.encode() for line in lines], job, workdir)


def _duplicate_column(job: list[str], clean: Path, workdir: Path) -> Outcome:
    data = workdir / "two_prompts.parquet"
    names = ["prompt", "prompt"]
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names), data)
    args = [*_plain(job), f"dataset.path={data}", f"output_dir={workdir / 'twocol_out'}"]
    code, said, _ = _run("twocol", args, workdir)
    return Outcome("a Parquet file with two prompt columns", code, _short(said, workdir), "-")


def _long_csv_record(job: list[str], clean: Path, workdir: Path) -> Outcome:
    data = workdir / "long.csv"
    data.write_text("prompt\nshort\n" + "w" * 5000 + "\nlast\n")
    args = [*_plain(job), f"dataset.path={data}", "dataset.max_prompt_bytes=1000"]
    code, said, _ = _run("longcsv", [*args, f"output_dir={workdir / 'longcsv_out'}"], workdir)
    return Outcome("a CSV record 5x dataset.max_prompt_bytes", code, _short(said, workdir), "-")
