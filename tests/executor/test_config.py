"""executor=local|ray composes into a typed ExecutorConfig; bad values, a missing Ray and a local
instance too small for the replicas all fail before anything loads, naming the fix."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from batchpage.executor import executor_factory
from batchpage.executor.config import ExecutorConfig
from batchpage.executor.ray_cluster import cluster_address, connect
from batchpage.job import JobConfigError, run_job
from batchpage.run import compose_job
from tests.executor.jobs import job, job_args, write_rows
from tests.extras import require
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_local_is_the_default_and_ray_takes_its_settings() -> None:
    assert compose_job([]).executor == ExecutorConfig(kind="local")
    cfg = compose_job(
        ["executor=ray", "executor.num_replicas=8", "executor.gpus_per_replica=1",
         "executor.address=auto", "executor.window_rows=128"]
    ).executor  # fmt: skip
    assert (cfg.kind, cfg.num_replicas, cfg.gpus_per_replica) == ("ray", 8, 1.0)
    assert (cfg.address, cfg.window_rows, cfg.cpus_per_replica) == ("auto", 128, 1)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "slurm"}, "executor=local or executor=ray"),
        ({"num_replicas": 0}, "executor.num_replicas=0 must be >= 1"),
        ({"window_rows": 0}, "executor.window_rows=0 must be >= 1"),
        ({"gpus_per_replica": -1.0}, "executor.gpus_per_replica=-1.0 must be >= 0"),
        ({"connect_timeout_s": 0.0}, "executor.connect_timeout_s=0.0 must be > 0"),
        ({"max_restarts": -1}, "executor.max_restarts=-1 must be >= 0"),
    ],
)
def test_bad_values_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(**changes)


def test_a_bad_value_on_the_command_line_exits_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", "executor=ray", "executor.num_replicas=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "executor.num_replicas=0 must be >= 1" in proc.stderr


def test_without_ray_the_job_stops_before_anything_loads(tmp_path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    data = write_rows(tmp_path / "d.jsonl", 3, bad=False)
    cfg = job(job_args(data, tmp_path / "no-model-needed", tmp_path / "out", "executor=ray"))
    with pytest.raises(JobConfigError, match=r"pip install 'batchpage\[ray\]'"):
        run_job(cfg)
    assert not (tmp_path / "out").exists()


def test_a_local_instance_too_small_for_the_replicas_is_refused() -> None:
    ray = require("ray", "ray")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    with pytest.raises(ValueError, match="lower executor.num_replicas"):
        connect(ExecutorConfig(kind="ray", num_replicas=4096))
    assert not ray.is_initialized()


def test_a_ray_client_address_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"ray://head:10001 is a Ray Client address.*=auto"):
        ExecutorConfig(kind="ray", address="ray://head:10001")


def _closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _silent(address: tuple[str, int], timeout: float) -> None:
    """socket.create_connection towards a host that drops the connection attempt."""
    time.sleep(timeout)
    raise TimeoutError("timed out")


@pytest.mark.parametrize(
    ("address", "timeout_s", "problem"),
    [
        ("127.0.0.1:{port}", 30.0, "nothing answered within 30 s"),  # refused at once
        ("10.1.2.3:6379", 0.5, "nothing answered within 0.5 s: timed out"),  # a silent host
        ("no-port-here", 30.0, "it is not host:port"),
    ],
)
def test_an_address_that_does_not_answer_is_one_line_within_the_timeout(
    address: str, timeout_s: float, problem: str, monkeypatch
) -> None:
    """Through the job's pre-flight (executor_factory), which ray.init never reaches here."""
    ray = require("ray", "ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if address.startswith("10."):  # this machine's network may answer any address
        monkeypatch.setattr(socket, "create_connection", _silent)
    address = address.format(port=_closed_port())
    cfg = ExecutorConfig(kind="ray", address=address, connect_timeout_s=timeout_s)
    start = time.monotonic()
    initialized = ray.is_initialized()
    with pytest.raises(ValueError, match=re.escape(problem)) as e:
        executor_factory(cfg)
    assert time.monotonic() - start < timeout_s + 5
    assert f"executor.address={address}" in str(e.value) and "ray status" in str(e.value)
    assert "\n" not in str(e.value) and ray.is_initialized() == initialized


def test_auto_dials_what_ray_would(tmp_path, monkeypatch) -> None:
    """RAY_ADDRESS wins over the setting; auto reads the newest local cluster's address."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address("auto") == cluster_address("head:6379") == "10.0.0.1:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster_address("head:6379") == "head:6379"
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    assert cluster_address("auto") is None  # no cluster started here: ray.init says so
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("192.168.1.5:6379\n")
    assert cluster_address("auto") == "192.168.1.5:6379"


def test_a_dead_cluster_address_stops_the_job_with_exit_2_before_anything(tmp_path) -> None:
    """Before the dataset or the model is even looked at (neither exists here)."""
    require("ray", "ray")
    port = _closed_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    args = job_args(tmp_path / "missing.jsonl", tmp_path / "model", tmp_path / "out",
                    "executor=ray", f"executor.address=127.0.0.1:{port}")  # fmt: skip
    cmd = [sys.executable, "-m", "batchpage.run", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and f"executor.address=127.0.0.1:{port}" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_port_that_accepts_but_never_answers_stops_the_job_within_the_timeout(
    tmp_path,
) -> None:
    """A stuck head (or another service on the port) takes the connection, so the pre-flight's
    probe passes, and ray.init would retry without a limit: joining is given up after
    executor.connect_timeout_s, exit 2, one line, before any model loads."""
    require("ray", "ray")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Hello"}\n')
    tokenizer = tiny_tokenizer()
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    model = save_hf_folder(hf, tmp_path / "model", tokenizer)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes handshakes; nothing ever reads
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        args = job_args(data, model, tmp_path / "out", "executor=ray",
                        f"executor.address={address}", "executor.connect_timeout_s=3")  # fmt: skip
        cmd = [sys.executable, "-m", "batchpage.run", *args]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert said and "accepts connections but no Ray head answered within 3 s" in said[0], said
    assert f"executor.address={address}" in said[0]
    assert seconds < 60
    assert not (tmp_path / "out" / "completions.parquet").exists()
