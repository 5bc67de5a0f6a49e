"""kill -9 of the driver of an executor=ray job, at a random moment while rows are being written,
then the same command: no row lost or written twice, and the output equals a clean local run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchpage.job import run_job
from tests.executor.jobs import compared, job, job_args, ray_args, shard_indices, write_rows

ROOT = Path(__file__).resolve().parents[2]


def cli(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}/hydra"]
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, **popen)


@pytest.mark.slow
def test_driver_killed_then_rerun_equals_a_clean_run(tmp_path, tiny_folder) -> None:
    pytest.importorskip("ray", reason="pip install 'batchpage[ray]'")
    data = write_rows(tmp_path / "d.jsonl", 40)
    out = tmp_path / "out"
    args = job_args(data, tiny_folder, out, "flush_rows=2", "sampling.max_tokens=8", *ray_args())
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = cli(args, tmp_path, stderr=err)
    deadline = time.monotonic() + 400
    # Kill once rows are being written, at a random moment after that.
    while proc.poll() is None and not list(out.glob("shard-*.parquet")):
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.05)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    log = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == -signal.SIGKILL, f"the job ended before the kill: {log}"
    indices = shard_indices(out)
    assert len(indices) == len(set(indices))

    proc = cli(args, tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err
    # The kill may land after the last row was written (in the final merge, or while Ray shuts
    # down): the rerun must then finish the job just the same.
    if len(indices) < 40:
        assert f"{len(indices)} rows already done" in err
    assert sorted(shard_indices(out)) == list(range(40))

    run_job(job(job_args(data, tiny_folder, tmp_path / "clean", "sampling.max_tokens=8")))
    assert compared(out) == compared(tmp_path / "clean")
