"""executor=local|ray composes into a typed ExecutorConfig; bad values, a missing Ray and a local
instance too small for the replicas all fail before anything loads, naming the fix."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchpage.executor.config import ExecutorConfig
from batchpage.executor.ray_cluster import connect
from batchpage.job import JobConfigError, run_job
from batchpage.run import compose_job
from tests.executor.jobs import job, job_args, write_rows

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
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    with pytest.raises(ValueError, match="lower executor.num_replicas"):
        connect(ExecutorConfig(kind="ray", num_replicas=4096))
    assert not ray.is_initialized()


def test_a_ray_client_address_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"ray://head:10001 is a Ray Client address.*=auto"):
        ExecutorConfig(kind="ray", address="ray://head:10001")
