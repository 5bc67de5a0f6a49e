"""Jobs on object storage end to end (the tiny random model, moto's S3 server): kill -9 at the
points where an object store differs from a disk, then a rerun, equal to a clean local run; a
server that fails requests (retried, and past the retries the job stops with its rows saved and
a rerun finishes them)."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.bench.object_storage import (
    AIMS,
    COMPARED,
    FINAL,
    job_args,
    kill_trial,
    rows_of,
    run_to_end,
    write_dataset,
)
from jobs.bench.random_models import random_model_folder
from tests.storage.flaky_proxy import FlakyProxy

ROOT = Path(__file__).resolve().parents[2]
ROWS, PAD = 48, 400_000  # completions.parquet past an upload part: a multipart upload to kill


@pytest.fixture(scope="module")
def setup(tmp_path_factory, s3_server):
    work = tmp_path_factory.mktemp("objects")
    model = random_model_folder("tiny")
    data = write_dataset(work / "prompts.jsonl", ROWS, PAD, seed=0)
    bucket = s3_server.new_bucket()
    s3_server.client().upload_file(str(data), bucket, "in/prompts.jsonl")
    code, _ = run_to_end(job_args(model, str(data), str(work / "local"), 8), {}, work,
                         work / "local.log")  # fmt: skip
    assert code == 0, (work / "local.log").read_text()[-2000:]
    clean = rows_of((work / "local" / FINAL).read_bytes())
    return work, model, bucket, s3_server.url(bucket, "in", "prompts.jsonl"), clean


@pytest.mark.slow
@pytest.mark.parametrize("aim", AIMS)
def test_a_kill_at_any_point_then_a_rerun_loses_nothing(setup, s3_server, aim: str) -> None:
    work, model, bucket, data, clean = setup
    prefix = f"kill-{AIMS.index(aim)}"
    trial = kill_trial(s3_server, model, data, bucket, prefix, aim, clean, work,
                       random.Random(0), 8)  # fmt: skip
    check = trial.check
    assert (check.rows, check.lost, check.duplicated, check.different) == (ROWS, 0, 0, 0)
    assert check.unreadable == 0 and check.uploads_left == 0 and check.manifest_ok
    assert trial.rerun_generated <= trial.unsaved  # no saved row generated again


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "batchpage.run", *args, f"hydra.run.dir={cwd}"]
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_failing_server_is_retried_and_past_the_retries_the_rows_are_redone(
    setup, s3_server
) -> None:
    work, model, bucket, data, clean = setup
    out = s3_server.url(bucket, "flaky")
    shard_puts = lambda method, path: method == "PUT" and "/shard-" in path  # noqa: E731
    with FlakyProxy(s3_server.endpoint) as proxy:
        env = s3_server.endpoint_at(proxy.endpoint)
        args = [*job_args(model, data, out, 8), "storage.retries=3"]
        proxy.fail_next(2, match=shard_puts)  # within the retries: the job never notices
        done = _run(args, env, work)
        assert done.returncode == 0, done.stderr[-2000:]
        assert proxy.counts.faults == 2
        want = {r["id"]: r for r in clean}
        got = rows_of(s3_server.read(f"{out}/{FINAL}"))
        assert len(got) == ROWS and all(r == want[r["id"]] for r in got)

        again = s3_server.url(bucket, "flaky-2")
        args = [*job_args(model, data, again, 8), "storage.retries=3"]
        proxy.fail_next(10_000, match=shard_puts)  # every shard write fails: past the retries
        stopped = _run(args, env, work)
        proxy.clear()
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert stopped.returncode == 2 and len(errors) == 1, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    assert "3 tries" in errors[0] and "rerun the same command" in errors[0]
    rerun = _run([*job_args(model, data, again, 8)], s3_server.env, work)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    table = pq.read_table(io.BytesIO(s3_server.read(f"{again}/{FINAL}")), columns=COMPARED)
    assert sorted(table.to_pylist(), key=lambda r: r["index"]) == clean
