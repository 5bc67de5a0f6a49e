"""Tensor parallelism through the job: engine.tensor_parallel_size=2 writes one rank's rows, and
a worker killed with SIGKILL mid-job ends it with one error naming the rank; the rerun resumes,
every row exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchpage.job import run_job
from batchpage.output import work_dir
from tests.job.test_loop import job, table, write_jsonl
from tests.job.test_run_cli import (
    cli,
    compared,
    hooked_cli,
    pause_after,
    tiny_job_args,
    write_prompts,
)

COLUMNS = ("index", "prompt", "completion", "finish_reason", "prompt_tokens", "error")


def test_a_two_rank_job_resumes_and_writes_one_ranks_rows(tmp_path: Path, tiny_folder) -> None:
    records = [{"prompt": f"The quick brown fox {i} jumps"} for i in range(7)]
    records.insert(3, {"prompt": ""})  # a bad row: its error, the rest run
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out, one = tmp_path / "out", tmp_path / "one"
    tp = {"tensor_parallel_size": 2}
    run_job(job(data, tiny_folder, out, engine=tp, dataset={"limit": 3}))
    run_job(job(data, tiny_folder, out, engine=tp))  # resumes: the other 5 rows
    run_job(job(data, tiny_folder, one))

    def rows(folder: Path) -> list[dict]:
        return [{k: r[k] for k in COLUMNS} for r in table(folder)]

    assert rows(out) == rows(one) and len(rows(out)) == 8
    assert sum(r["error"] is not None for r in rows(out)) == 1


def test_a_killed_worker_ends_the_job_and_the_rerun_has_every_row_once(
    tmp_path: Path, tiny_folder
) -> None:
    data = write_prompts(tmp_path / "d.jsonl", 24)
    out = tmp_path / "out"
    args = [
        *tiny_job_args(data, tiny_folder, out),
        "engine.tensor_parallel_size=2",
        "dataset.window_rows=4",
        "flush_rows=1",
        "sampling.max_tokens=6",
    ]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = hooked_cli(
            pause_after(3, resume_on_usr1=True), args, tmp_path, stdout=subprocess.PIPE, stderr=err
        )
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    while lines[-1] not in ("PAUSED\n", ""):
        lines.append(proc.stdout.readline())
    assert lines[-1] == "PAUSED\n", (lines, log.read_text()[-3000:])
    found = subprocess.run(
        ["pgrep", "-P", str(proc.pid), "-f", "batchpage.distributed.worker"],
        capture_output=True,
        text=True,
    )
    (worker,) = [int(p) for p in found.stdout.split()]
    os.kill(worker, signal.SIGKILL)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    err = log.read_text()
    assert proc.returncode == 1, err
    assert f"rank 1 (pid {worker}, killed by signal 9) died" in err, err
    assert f"rerun with output_dir={out} to resume" in err and "Traceback" not in err
    saved = {
        i
        for s in work_dir(out).glob("shard-*.parquet")
        for i in pq.read_table(s)["index"].to_pylist()
    }
    assert 3 <= len(saved) < 24
    rerun = cli(args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, rerun_err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, rerun_err
    rows = compared(out)
    assert sorted(r["index"] for r in rows) == list(range(24))
    assert all(r["error"] is None and r["completion"] for r in rows)
    one = tmp_path / "one"
    one_rank = [a for a in args if not a.startswith(("engine.tensor", "output_dir"))]
    fresh = cli([*one_rank, f"output_dir={one}"], tmp_path, stderr=subprocess.PIPE)
    assert fresh.wait(timeout=300) == 0
    assert rows == compared(one)


def test_ray_replicas_whose_cpus_do_not_split_over_their_ranks_are_refused_before_loading(
    tmp_path: Path, tiny_folder
) -> None:
    from batchpage.job import JobConfigError
    from tests.executor.jobs import job as ray_job
    from tests.executor.jobs import job_args

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    args = job_args(data, tiny_folder, tmp_path / "out", "executor=ray")
    with pytest.raises(JobConfigError, match=r"cpus_per_replica=3 does not split over .*=2 ranks"):
        run_job(ray_job([*args, "engine.tensor_parallel_size=2", "executor.cpus_per_replica=3"]))
    with pytest.raises(JobConfigError, match=r"gpus_per_replica=1 does not split .* use 2"):
        run_job(ray_job([*args, "engine.tensor_parallel_size=2", "executor.cpus_per_replica=2",
                         "executor.gpus_per_replica=1"]))  # fmt: skip
    assert not (tmp_path / "out").exists()
