"""kill -9 of the driver of an executor=ray job while rows are being written, then the same
command: no row lost or written twice, and the output equals a clean local run.

The kill lands while the driver is paused by a hook (tests.job.test_run_cli.hooked_cli) after a
chosen number of rows, with replicas still holding windows, whatever the machine's speed."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from batchpage.job import run_job
from tests.executor.jobs import compared, job, job_args, ray_args, shard_indices, write_rows
from tests.extras import require
from tests.job.test_run_cli import cli, hooked_cli, pause_after

ROWS = 40
# Rows 1 and 4 are errors written before anything is generated: pausing well after them means
# generated rows are on disk and the replicas are mid-job when the kill lands.
PAUSE_AT = 11
PAUSE_TIMEOUT_S = 600  # starting Ray and two replicas on a loaded 2-core machine


def wait_for_pause(proc: subprocess.Popen, stdout: Path, stderr: Path) -> None:
    """Returns once the hook said PAUSED; fails, saying why, if the job ended or never got
    there. Ray's log lines share the driver's stdout, so the word is looked for anywhere."""
    deadline = time.monotonic() + PAUSE_TIMEOUT_S
    while "PAUSED\n" not in stdout.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(
                f"the job ended (exit {proc.returncode}) before pausing at row {PAUSE_AT}:\n"
                + stderr.read_text()[-3000:]
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(
                f"the job did not reach row {PAUSE_AT} within {PAUSE_TIMEOUT_S} s:\n"
                + stderr.read_text()[-3000:]
            )
        time.sleep(0.05)  # polling for the event, not a guess at when it comes


@pytest.mark.slow
def test_driver_killed_then_rerun_equals_a_clean_run(tmp_path, tiny_folder) -> None:
    require("ray", "ray")
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "out"
    args = job_args(data, tiny_folder, out, "flush_rows=2", "sampling.max_tokens=8", *ray_args())
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = hooked_cli(pause_after(PAUSE_AT), args, tmp_path, stdout=so, stderr=se)
    try:
        wait_for_pause(proc, stdout, stderr)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr.read_text()
    indices = shard_indices(out)
    assert len(indices) == len(set(indices)), "a row was written twice"
    # Flushed every 2 rows (or on the flush clock): at most the last row was still buffered.
    assert PAUSE_AT - 1 <= len(indices) <= PAUSE_AT

    proc = cli(args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert f"{len(indices)} rows already done" in err
    assert sorted(shard_indices(out)) == list(range(ROWS))

    run_job(job(job_args(data, tiny_folder, tmp_path / "clean", "sampling.max_tokens=8")))
    assert compared(out) == compared(tmp_path / "clean")
