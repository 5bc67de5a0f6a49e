"""Output folders in object storage (S3 through moto's server, GCS through the emulator): the
same ShardWriter and finalize as for a local folder, read back with boto3 /
google-cloud-storage. completions.parquet equals the local one byte for byte and appears only at
the end; a shard key is never overwritten; one live writer per folder (a lease), taken over once
it expires; a writer that lost its lease stops; a kill leaves nothing visible and no upload."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchpage.output import (
    FINAL_FILE,
    SUCCESS_FILE,
    OutputDirError,
    ResultRow,
    ShardWriter,
    finalize,
    verify,
)
from batchpage.storage import OutputLostError, StorageConfig, Stores
from tests.output.conftest import LEASE_S, Bucket, result_rows
from tests.storage_servers import REPO

JOB = {"model": "tiny", "sampling": {"temperature": 0.0}, "dataset": "fp1"}


def local_completions(tmp_path: Path, rows: list[ResultRow], **finalize_args: int) -> bytes:
    """completions.parquet of the same rows written into a local folder: the reference."""
    out = tmp_path / "local"
    with ShardWriter(out, JOB, flush_rows=4) as w:
        w.add_many(rows)
    return Path(finalize(out, len(rows), **finalize_args).path).read_bytes()


def top_level(bucket: Bucket, url: str) -> list[str]:
    """Object names directly in the folder (not in .batchpage/), through the reference client."""
    names = [key[len(url) + 1 :] for key in bucket.server.keys(url + "/")]
    return sorted(n for n in names if "/" not in n)


def take_over(bucket: Bucket, url: str, deadline_s: float) -> tuple[ShardWriter, float]:
    """A writer of `url` once the folder is free, and how long that took; fails past the
    deadline."""
    start = time.monotonic()
    while True:
        try:
            w = ShardWriter(url, JOB, flush_rows=2, store=bucket.store, lease_seconds=LEASE_S)
            return w, time.monotonic() - start
        except OutputDirError as e:
            assert "is in use by another batchpage job" in str(e)
            assert time.monotonic() - start < deadline_s, "the dead writer's lease never expired"
            time.sleep(0.2)


# A writer in another process, which the test stops or kills. `hold`: write the rows (those
# past the last full shard stay buffered), say "ready" and keep the lease by heartbeats. `beat`:
# one row per shard, saying "flushed <i>" after each, until it loses the folder.
CHILD = """
import sys, time
from batchpage.output import ShardWriter
from batchpage.storage import OutputLostError
from tests.output.conftest import result_rows
mode, url, lease = sys.argv[1], sys.argv[2], float(sys.argv[3])
count, flush = int(sys.argv[4]), int(sys.argv[5])
job = {"model": "tiny", "sampling": {"temperature": 0.0}, "dataset": "fp1"}
w = ShardWriter(url, job, flush_rows=flush, flush_seconds=1e9, lease_seconds=lease)
rows = result_rows(count)
if mode == "hold":
    w.add_many(rows)
    print("ready", flush=True)
    while True:
        time.sleep(1)
try:
    for row in rows:
        w.add(row)
        w.flush()  # the shard saved (add only hands it to the upload thread)
        print(f"flushed {row.index}", flush=True)
        time.sleep(0.5)
except OutputLostError as e:
    print(f"lost: {e}", flush=True)
    sys.exit(3)
"""


def child(bucket: Bucket, mode: str, url: str, count: int, flush: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", CHILD, mode, url, str(LEASE_S), str(count), str(flush)]
    env = {**os.environ, **bucket.server.env}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def test_completions_equal_a_local_folders_byte_for_byte(bucket: Bucket, tmp_path: Path) -> None:
    rows = result_rows(30)
    url = bucket.url("run-1")
    with ShardWriter(url, JOB, flush_rows=4, store=bucket.store) as w:
        w.add_many(reversed(rows))  # another order and other shards than the local run's
        w.add_many(rows[:5])  # offered again: dropped
    result = finalize(url, len(rows), store=bucket.store)
    assert result.path == url + "/" + FINAL_FILE and result.rows == 30
    assert result.errors == sum(r.error is not None for r in rows)
    data = bucket.server.read(url + "/" + FINAL_FILE)
    assert data == local_completions(tmp_path, rows)
    table = pq.read_table(io.BytesIO(data))
    assert table.column("index").to_pylist() == list(range(30))
    assert table.column("completion").to_pylist() == [r.completion for r in rows]


def test_nothing_is_visible_at_the_top_before_finalize(bucket: Bucket) -> None:
    url = bucket.url("run-1")
    rows = result_rows(9)
    with ShardWriter(url, JOB, flush_rows=2, store=bucket.store, lease_seconds=LEASE_S) as w:
        w.add_many(rows)
        assert top_level(bucket, url) == []  # shards, job.json and the lease are below
        shards = [k for k in bucket.server.keys(url + "/") if "/shard-" in k]
        assert len(shards) == 4  # 8 rows flushed, 1 buffered
    assert top_level(bucket, url) == []  # closed: still not done
    finalize(url, len(rows), store=bucket.store)
    assert top_level(bucket, url) == [SUCCESS_FILE, FINAL_FILE]
    assert not [k for k in bucket.server.keys(url + "/") if "/lease/" in k]  # released


def test_a_shard_key_someone_else_created_is_never_overwritten(bucket: Bucket) -> None:
    url = bucket.url("run-1")
    theirs = url + "/.batchpage/shard-00000.parquet"
    w = ShardWriter(url, JOB, flush_rows=2, store=bucket.store, lease_seconds=LEASE_S)
    with pytest.raises(OutputLostError) as err, w:
        assert bucket.store.create_bytes(theirs, b"another writer's shard")
        w.add_many(result_rows(2))  # the flush is due: its key is taken
    message = str(err.value)
    assert theirs in message and "created by another writer" in message and "\n" not in message
    assert bucket.server.read(theirs) == b"another writer's shard"
    assert w.num_saved == 0  # the rows stay unsaved: a rerun generates them
    assert [k for k in bucket.server.keys(url + "/") if "/shard-" in k] == [theirs]


def test_resume_after_a_writer_dropped_without_close(bucket: Bucket, tmp_path: Path) -> None:
    """The flushed shards' rows are kept, the buffered ones are generated again."""
    rows = result_rows(11)
    url = bucket.url("run-1")
    w = ShardWriter(url, JOB, flush_rows=3, flush_seconds=1e9, store=bucket.store)
    w.add_many(rows[:8])  # 2 shards, 2 rows buffered
    w._buffer = []  # dropped: the buffer is lost with the process ...
    w._release()  # ... and its lock goes (a lease deleted, as by a release)
    with ShardWriter(url, JOB, flush_rows=3, store=bucket.store) as again:
        assert again.done_indices() == frozenset(range(6))
        assert again.add_many(rows) == 5
    finalize(url, 11, store=bucket.store)
    assert bucket.server.read(url + "/" + FINAL_FILE) == local_completions(tmp_path, rows)


def test_a_second_writer_waits_for_the_first_and_takes_over_when_it_dies(
    bucket: Bucket, tmp_path: Path
) -> None:
    """Refused in one line while the first lives (past its first lease: heartbeats keep it),
    free once the killed writer's lease runs out; its flushed rows are kept."""
    url = bucket.url("run-1")
    rows = result_rows(7)
    first = child(bucket, "hold", url, 7, 3)  # 6 rows in shards, 1 buffered
    try:
        assert first.stdout is not None and first.stdout.readline() == "ready\n"
        time.sleep(1.5 * LEASE_S)
        with pytest.raises(OutputDirError) as err:
            ShardWriter(url, JOB, store=bucket.store, lease_seconds=LEASE_S)
        message = str(err.value)
        assert message.startswith(f"output_dir {url} is in use by another batchpage job")
        assert f"pid {first.pid}" in message and "\n" not in message
    finally:
        first.kill()  # kill -9: no release, the lease stays until it expires
        first.wait()
    w, waited = take_over(bucket, url, deadline_s=LEASE_S + 30)
    assert waited <= LEASE_S + 5
    with w:
        assert w.done_indices() == frozenset(range(6))
        assert w.add_many(rows) == 1
    finalize(url, 7, store=bucket.store)
    assert bucket.server.read(url + "/" + FINAL_FILE) == local_completions(tmp_path, rows)


def test_a_writer_that_lost_its_lease_stops_without_writing(bucket: Bucket) -> None:
    """Paused past its lease (SIGSTOP), the first writer finds on waking that the folder is
    another's: its next flush raises OutputLostError and no shard of it appears after that."""
    url = bucket.url("run-1")
    first = child(bucket, "beat", url, 200, 1)
    try:
        assert first.stdout is not None and first.stdout.readline() == "flushed 0\n"
        first.send_signal(signal.SIGSTOP)  # between two flushes: it sleeps after each
        w, _ = take_over(bucket, url, deadline_s=LEASE_S + 30)
        saved = sorted(w.done_indices())
        shards = [k for k in bucket.server.keys(url + "/") if "/shard-" in k]
        first.send_signal(signal.SIGCONT)
        out, _ = first.communicate(timeout=60)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 3, out
    assert "lost: " in out and "lost its lease" in out
    assert [k for k in bucket.server.keys(url + "/") if "/shard-" in k] == shards
    with w:
        w.add_many(result_rows(200)[:20])
    final = finalize(url, 20, store=bucket.store).path
    table = pq.read_table(io.BytesIO(bucket.server.read(final)))
    assert table.column("index").to_pylist() == list(range(20))
    assert saved == list(range(len(saved))) and saved  # what the first saved is kept


# finalize in another process, killed (SIGKILL) in the middle of writing completions.parquet:
# after the first of its two buckets is written, which is more than an upload part
# (objects.WRITE_BLOCK).
KILLED_IN_FINALIZE = """
import importlib, os, signal, sys
from batchpage.output import ShardWriter, finalize
from batchpage.storage import StorageConfig, Stores
from tests.output.conftest import result_rows
url, count = sys.argv[1], int(sys.argv[2])
store = Stores(StorageConfig()).store_for(url)
job = {"model": "tiny", "sampling": {"temperature": 0.0}, "dataset": "fp1"}
with ShardWriter(url, job, flush_rows=10, store=store) as w:
    w.add_many(result_rows(count, text_bytes=900_000))
merge = importlib.import_module("batchpage.output.finalize")._Merge
buckets = merge.buckets
def written_then_killed(self):
    for number, table in enumerate(buckets(self)):
        if number == 1:  # the first bucket is in completions.parquet's stream
            os.kill(os.getpid(), signal.SIGKILL)
        yield table
merge.buckets = written_then_killed
finalize(url, count, rows_per_bucket=count // 2, store=store)
"""


def test_a_kill_in_finalize_leaves_no_output_and_the_next_writer_aborts_the_upload(
    bucket: Bucket, tmp_path: Path
) -> None:
    url = bucket.url("run-1")
    count = 80  # two buckets of over 20 MB: the first is sent as an upload part before the kill
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_IN_FINALIZE, url, str(count)],
        cwd=REPO,
        env={**os.environ, **bucket.server.env},
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL
    assert top_level(bucket, url) == []
    key = f"run-1/{FINAL_FILE}"
    if bucket.kind == "s3":
        assert bucket.server.pending_uploads(bucket.name) == [key]
    ShardWriter(url, JOB, store=bucket.store).close()  # the next writer cleans up
    if bucket.kind == "s3":
        assert bucket.server.pending_uploads(bucket.name) == []
    finalize(url, count, rows_per_bucket=count // 2, store=bucket.store)
    rows = result_rows(count, text_bytes=900_000)
    local = local_completions(tmp_path, rows, rows_per_bucket=count // 2)
    assert bucket.server.read(url + "/" + FINAL_FILE) == local
    assert verify(bucket.store, url)["files"][0]["rows"] == count


def test_the_default_store_comes_from_the_url(bucket: Bucket) -> None:
    """Without a store argument, ShardWriter and finalize take the URL's own (the storage
    options of the environment), as a script outside a job would."""
    url = bucket.url("run-1")
    with ShardWriter(url, JOB) as w:
        assert w.store.scheme == bucket.store.scheme and w.store is not bucket.store
        w.add_many(result_rows(3))
    finalize(url, 3)
    manifest = json.loads(bucket.server.read(url + "/" + SUCCESS_FILE))
    assert [f["name"] for f in manifest["files"]] == [FINAL_FILE]
    assert Stores(StorageConfig()).store_for(url).exists(url + "/" + FINAL_FILE)
