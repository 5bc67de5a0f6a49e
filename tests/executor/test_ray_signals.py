"""SIGINT and SIGTERM sent to the driver of an executor=ray job (two replicas on the local Ray
instance the job started): it exits 130 / 143 within STOP_BOUND_S with the rows finished so far
saved, no process of that Ray instance is left, and a rerun resumes them, every row once, equal
to a clean local run. (ray.init used to put in Ray's own SIGTERM handler, which exited at once
with no message, or aborted in Ray's teardown.)

The signal lands while the driver is paused by a hook after a chosen number of rows, with the
replicas still holding windows. The rerun is local: resuming under Ray is test_ray_resume's."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from batchpage.job import run_job
from tests.distributed.test_signals import EXIT, MESSAGE, signal_and_time
from tests.executor.cluster_nodes import descendants, running
from tests.executor.jobs import compared, job, job_args, ray_args, shard_indices, write_rows
from tests.executor.test_ray_resume import PAUSE_AT, ROWS, wait_for_pause
from tests.extras import require
from tests.job.test_run_cli import hooked_cli, pause_after

STOP_BOUND_S = 20.0  # from the signal to the driver's exit: it also shuts its Ray instance down
GONE_S = 10.0  # after the exit, for Ray's last processes (its workers end as their raylet does)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_ends_a_ray_job_promptly_and_the_rerun_resumes(
    tmp_path: Path, tiny_folder: Path, sig: int
) -> None:
    require("ray", "ray")
    data = write_rows(tmp_path / "d.jsonl", ROWS)
    out = tmp_path / "out"
    args = job_args(data, tiny_folder, out, "flush_rows=2", "sampling.max_tokens=8")
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(stdout, "w") as so, open(stderr, "w") as se:
        proc = hooked_cli(
            pause_after(PAUSE_AT),
            [*args, *ray_args()],
            tmp_path,
            stdout=so,
            stderr=se,
            start_new_session=True,
        )
    try:
        wait_for_pause(proc, stdout, stderr)
        ray_processes = running(descendants(proc.pid))
        assert ray_processes  # its GCS, raylet and workers (the replicas among them)
        seconds = signal_and_time(proc, sig, whole_group=False, patience=120.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = stderr.read_text()
    assert proc.returncode == EXIT[sig], err[-3000:]
    assert seconds < STOP_BOUND_S, (seconds, err[-3000:])
    assert f"{MESSAGE[sig]}: finished rows are saved; rerun with output_dir={out}" in err
    deadline = time.monotonic() + GONE_S
    while running(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for the processes' end, not a guess at when it comes
    assert running(ray_processes) == [], "a process of the job's Ray instance outlived it"
    indices = shard_indices(out)
    # Every row the driver had been handed, the one it paused in included (saved on the way out).
    assert sorted(indices) == sorted(set(indices)) and len(indices) == PAUSE_AT

    result = run_job(job(args))  # resumed, locally
    assert result.rows_resumed == PAUSE_AT and result.rows == ROWS
    assert sorted(shard_indices(out)) == list(range(ROWS))
    clean = job(job_args(data, tiny_folder, tmp_path / "clean", "sampling.max_tokens=8"))
    run_job(clean)
    assert compared(out) == compared(tmp_path / "clean")
