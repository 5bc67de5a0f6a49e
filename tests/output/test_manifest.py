"""The commit point `_SUCCESS` (batchpage/output/manifest.py), on local folders, S3 and GCS: it
lists each output file with the rows, size and sha256 of the bytes a reference reader gets
(hashlib over what the file system, boto3 or google-cloud-storage returns) and the shards
merged; it is withdrawn before any output file is rewritten; `verify` finds what differs; a job
commits after its last output file (OpenAI Batch files too) and writes run.json after that."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchpage import LLM
from batchpage.job import run_job
from batchpage.output import (
    FINAL_FILE,
    SUCCESS_FILE,
    ManifestError,
    ShardWriter,
    finalize,
    read_manifest,
    verify,
)
from batchpage.output.files import BATCH_ERRORS_FILE, BATCH_OUTPUT_FILE, RUN_FILE
from batchpage.run import summary
from batchpage.storage import LocalStore, Store
from tests.output.conftest import Bucket, Folder, result_rows

JOB = {"model": "tiny", "sampling": {"temperature": 0.0}, "dataset": "fp1"}
finalize_module = importlib.import_module("batchpage.output.finalize")


class Boom(Exception):
    pass


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(url: str, store: Store, count: int, flush_rows: int = 3) -> None:
    with ShardWriter(url, JOB, flush_rows=flush_rows, store=store) as w:
        w.add_many(result_rows(count))


def test_success_lists_each_file_and_shard_as_the_reference_reads_them(folder: Folder) -> None:
    url, store = folder.url, folder.store
    started = time.time()
    write(url, store, 10)
    finalize(url, 10, store=store)
    manifest = json.loads(folder.read(store.join(url, SUCCESS_FILE)))
    data = folder.read(store.join(url, FINAL_FILE))
    assert manifest["files"] == [
        {"name": FINAL_FILE, "rows": 10, "bytes": len(data), "sha256": sha256(data)}
    ]
    assert pq.read_metadata(io.BytesIO(data)).num_rows == 10
    shard_keys = [k for k in folder.keys(store.join(url, ".batchpage")) if "shard-" in k]
    shards = [folder.read(k) for k in shard_keys]
    assert manifest["shards"] == [
        {
            "name": store.name(key),
            "rows": pq.read_metadata(io.BytesIO(shard)).num_rows,
            "sha256": sha256(shard),
        }
        for key, shard in zip(shard_keys, shards, strict=True)
    ]
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 3, 1]
    job = json.loads(folder.read(store.join(url, ".batchpage", "job.json")))
    assert manifest["fingerprint"] == manifest["jobId"] == job["fingerprint"]
    assert manifest["filenames"] == [store.join(url, FINAL_FILE)]
    assert started * 1000 <= manifest["timestamp"] <= time.time() * 1000
    assert manifest["committer"] == "batchpage" and manifest["metrics"]["rows"] == 10
    assert verify(store, url) == read_manifest(store, url) == manifest


def test_an_object_stores_manifest_lists_what_a_local_run_writes(
    bucket: Bucket, tmp_path: Path
) -> None:
    local = str(tmp_path / "local")
    write(local, LocalStore(), 12, flush_rows=5)
    finalize(local, 12)
    url = bucket.url("run-1")
    write(url, bucket.store, 12, flush_rows=5)
    finalize(url, 12, store=bucket.store)
    here, there = read_manifest(LocalStore(), local), read_manifest(bucket.store, url)
    assert here is not None and there is not None
    assert there["files"] == here["files"] and there["shards"] == here["shards"]


def test_verify_names_what_differs(folder: Folder) -> None:
    url, store = folder.url, folder.store
    with pytest.raises(ManifestError, match="_SUCCESS is missing"):
        verify(store, url)
    write(url, store, 5)
    finalize(url, 5, store=store)
    final = store.join(url, FINAL_FILE)
    good = folder.read(final)
    store.write_bytes(final, good[:-1] + b"!")  # same size, other bytes
    with pytest.raises(ManifestError) as err:
        verify(store, url)
    assert "completions.parquet's sha256" in str(err.value) and "bytes" not in str(err.value)
    store.write_bytes(final, good + b"x")
    with pytest.raises(ManifestError, match=f"completions.parquet's bytes is {len(good) + 1}"):
        verify(store, url)
    store.delete(final)
    with pytest.raises(ManifestError, match="completions.parquet is missing"):
        verify(store, url)
    store.write_bytes(final, good)
    assert verify(store, url)["files"][0]["sha256"] == sha256(good)


def test_success_is_withdrawn_before_completions_is_rewritten(
    folder: Folder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun's merge that fails part-way leaves the old completions.parquet (written whole
    or not at all) and no _SUCCESS: never a manifest of other bytes."""
    url, store = folder.url, folder.store
    write(url, store, 6)
    finalize(url, 6, store=store)
    before = folder.read(store.join(url, FINAL_FILE))
    buckets = finalize_module._Merge.buckets

    def fails(self: Any) -> Iterator[Any]:
        yield from buckets(self)
        raise Boom

    with monkeypatch.context() as patched:  # (undo() would drop the server's environment too)
        patched.setattr(finalize_module._Merge, "buckets", fails)
        with pytest.raises(Boom):
            finalize(url, 6, store=store)
    assert not store.exists(store.join(url, SUCCESS_FILE))
    assert folder.read(store.join(url, FINAL_FILE)) == before
    finalize(url, 6, store=store)
    assert verify(store, url)["files"][0]["sha256"] == sha256(before)


def test_overwrite_deletes_success_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    write(str(out), LocalStore(), 4)
    finalize(out, 4)
    deleted: list[str] = []
    delete = LocalStore.delete

    def recorded(self: LocalStore, path: str) -> None:
        deleted.append(Path(path).name)
        delete(self, path)

    monkeypatch.setattr(LocalStore, "delete", recorded)
    ShardWriter(out, {**JOB, "model": "other"}, overwrite=True).close()
    assert deleted[0] == SUCCESS_FILE and FINAL_FILE in deleted
    assert sorted(p.name for p in out.iterdir()) == [".batchpage"]


# --- the job: the commit after the last output file, run.json after the commit ------------------

ENGINE = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256}


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder: Path) -> LLM:
    return LLM(str(tiny_folder), **ENGINE)


def batch_requests(path: Path) -> Path:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": f"Q {i}"}]},
        }
        for i in range(5)
    ]
    lines.insert(2, {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_job_commits_its_batch_files_then_writes_run_json(
    tmp_path: Path, tiny_folder: Path, tiny_llm: LLM
) -> None:
    from tests.job.test_loop import job

    data = batch_requests(tmp_path / "requests.jsonl")
    out = tmp_path / "out"
    result = run_job(job(data, tiny_folder, out), lambda *a, **k: tiny_llm)
    assert result.output_dir == str(out) and result.completions == str(out / FINAL_FILE)
    manifest = verify(LocalStore(), str(out))
    listed = {f["name"]: f for f in manifest["files"]}
    assert sorted(listed) == sorted([FINAL_FILE, BATCH_OUTPUT_FILE, BATCH_ERRORS_FILE])
    for name, entry in listed.items():
        data_bytes = (out / name).read_bytes()
        assert (entry["bytes"], entry["sha256"]) == (len(data_bytes), sha256(data_bytes))
    assert listed[BATCH_OUTPUT_FILE]["rows"] == 5 and listed[BATCH_ERRORS_FILE]["rows"] == 1
    assert listed[FINAL_FILE]["rows"] == 6
    # The report comes after the commit; the output files before it.
    success = (out / SUCCESS_FILE).stat().st_mtime_ns
    assert (out / RUN_FILE).stat().st_mtime_ns >= success
    assert all((out / name).stat().st_mtime_ns <= success for name in listed)


def test_a_job_into_a_bucket_equals_the_same_job_into_a_folder(
    bucket: Bucket, tmp_path: Path, tiny_folder: Path, tiny_llm: LLM
) -> None:
    """Same input, same engine: completions.parquet byte for byte, the same manifest entry,
    and every file of the job (progress.json, run.json) in the bucket."""
    from tests.job.test_loop import job, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Tell me {i}"} for i in range(7)])
    local = run_job(job(data, tiny_folder, tmp_path / "out"), lambda *a, **k: tiny_llm)
    url = bucket.url("jobs", "run-42")
    remote = run_job(job(data, tiny_folder, url), lambda *a, **k: tiny_llm)
    assert remote.output_dir == url and remote.completions == f"{url}/{FINAL_FILE}"
    assert f"-> {url}/{FINAL_FILE}" in summary(remote)
    assert bucket.server.read(remote.completions) == Path(local.completions).read_bytes()
    here = read_manifest(LocalStore(), local.output_dir)
    there = json.loads(bucket.server.read(f"{url}/{SUCCESS_FILE}"))
    assert here is not None and there["files"] == here["files"]
    top = sorted(k.rpartition("/")[2] for k in bucket.server.keys(url + "/") if "/." not in k)
    assert top == sorted([SUCCESS_FILE, FINAL_FILE, RUN_FILE, "progress.json"])
    run = json.loads(bucket.server.read(f"{url}/{RUN_FILE}"))
    assert run["metrics"]["rows"] == 7 and run["config"]["job"]["output_dir"] == url
    again = run_job(job(data, tiny_folder, url), lambda *a, **k: tiny_llm)  # resumes: all done
    assert (again.rows_resumed, again.rows_generated) == (7, 0)
    assert len(json.loads(bucket.server.read(f"{url}/{RUN_FILE}"))["runs"]) == 1
    assert verify(bucket.store, url)["files"] == there["files"]
    assert os.path.exists(local.completions)


def test_a_job_whose_shard_key_another_writer_took_stops_and_the_rerun_resumes(
    bucket: Bucket, tmp_path: Path, tiny_folder: Path, tiny_llm: LLM
) -> None:
    """Another writer creating the job's next shard key (two jobs on one folder) stops the job
    in one line (JobStoppedError: exit 2), its saved rows kept; the rerun sets the foreign
    shard aside and ends with the rows of a clean run."""
    from batchpage.job.plan import JobStoppedError
    from tests.job.test_job_stops import AfterFirstWindow
    from tests.job.test_loop import COMPARED, job, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Tell me {i}"} for i in range(7)])
    url = bucket.url("run-1")
    theirs = f"{url}/.batchpage/shard-00001.parquet"  # a window of 3: shard 0 holds 2 rows

    def another_writer() -> None:
        assert bucket.store.create_bytes(theirs, b"not ours")

    with pytest.raises(JobStoppedError) as err:
        run_job(job(data, tiny_folder, url), AfterFirstWindow(tiny_llm, another_writer))
    message = str(err.value)
    assert "\n" not in message and theirs in message and "created by another writer" in message
    assert "2 rows this job saved" in message and "rerun with the same output_dir" in message
    assert bucket.server.read(theirs) == b"not ours"
    assert not bucket.store.exists(f"{url}/{FINAL_FILE}")
    with pytest.warns(UserWarning, match="unreadable shard"):
        again = run_job(job(data, tiny_folder, url), lambda *a, **k: tiny_llm)
    assert (again.rows_resumed, again.rows_generated) == (2, 5)
    clean = run_job(job(data, tiny_folder, tmp_path / "clean"), lambda *a, **k: tiny_llm)
    got = pq.read_table(io.BytesIO(bucket.server.read(again.completions)), columns=COMPARED)
    assert got == pq.read_table(clean.completions, columns=COMPARED)
    assert verify(bucket.store, url)["metrics"]["rows"] == 7
