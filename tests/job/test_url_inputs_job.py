"""A job whose inputs are at a URL (issue #70 item 2). Objects that change while the job reads
them: InputWatch compares each one's size and version (S3's ETag, GCS's generation) at every
window, as it compares a local file's size, mtime and inode, and the job stops with the same
one-line message, its saved rows kept (the objects are written with the services' own clients,
behind the job's back). An output_dir that is, holds or lies in the input's prefix is refused
before the model loads, as a local one is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchpage import LLM
from batchpage.data import DatasetSpec, validate
from batchpage.job import JobConfigError, run_job
from batchpage.job.input_watch import InputWatch
from batchpage.job.plan import JobStoppedError, plan_job
from batchpage.storage import Stores
from tests.data.test_url_inputs import jsonl, put
from tests.job.test_job_stops import AfterFirstWindow, saved_indices
from tests.job.test_loop import COMPARED, job, never, prompts, table, write_jsonl
from tests.storage_servers import StorageServer


@pytest.fixture(params=["s3", "gcs"])
def server(request: pytest.FixtureRequest) -> StorageServer:
    """Each object store's server in turn, with its environment set for the test."""
    return request.getfixturevalue("s3_env" if request.param == "s3" else "gcs_env")


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder: Path) -> LLM:
    """One engine for every job of this module (the job settings of tests.job.test_loop)."""
    return LLM(str(tiny_folder), dtype="float32", kv_cache_memory=2**22, max_model_len=256)


def stopped(url: str, what: str) -> str:
    return rf"^input file {re.escape(url)} changed while the job ran \({what}\)[^\n]*$"


@pytest.mark.parametrize("count", [3, 40])  # 40: more than one request each, watched by listing
def test_a_changed_or_removed_object_is_named(server: StorageServer, count: int) -> None:
    root = server.url(server.new_bucket(), "in")
    urls = [f"{root}/p{i:02d}.jsonl" for i in range(count)]
    for i, url in enumerate(urls):
        put(server, url, jsonl([{"prompt": f"prompt {i}"}]))
    stores = Stores()
    info = validate(DatasetSpec(path=f"{root}/"), stores)
    assert list(info.files) == urls

    def watch() -> InputWatch:
        return InputWatch(info.files, info.fingerprint["files"], "out-dir", stores)

    first = watch()
    first.check()
    put(server, urls[1], jsonl([{"prompt": "prompt 1, and more"}]))
    with pytest.raises(JobStoppedError, match=stopped(urls[1], r"size \d+ -> \d+ bytes")):
        first.check()
    put(server, urls[1], jsonl([{"prompt": "PROMPT 1"}]))  # the size it had: a new version
    with pytest.raises(JobStoppedError, match=stopped(urls[1], "it was modified or replaced")):
        first.check()
    with pytest.raises(JobStoppedError, match="its contents differ"):
        first.check_digests()
    put(server, urls[1], jsonl([{"prompt": "prompt 1"}]))  # its first bytes again
    if server.scheme == "s3":  # the ETag is the bytes' MD5: the same object again
        first.check()
        first.check_digests()
    else:  # a GCS generation is new with every upload: it stands for the bytes
        with pytest.raises(JobStoppedError, match="it was modified or replaced"):
            first.check()
    last = watch()
    delete(server, urls[-1])
    with pytest.raises(JobStoppedError, match=stopped(urls[-1], "it was removed")):
        last.check()


def delete(server: StorageServer, url: str) -> None:
    bucket, _, key = url.partition("://")[2].partition("/")
    if server.scheme == "s3":
        server.client().delete_object(Bucket=bucket, Key=key)
    else:
        server.client().bucket(bucket).blob(key).delete()


def test_a_job_whose_input_object_changes_stops_and_keeps_its_rows(
    server: StorageServer, tmp_path: Path, tiny_llm: LLM, tiny_folder: Path
) -> None:
    original = write_jsonl(tmp_path / "d.jsonl", prompts(12)).read_bytes()
    url = server.url(server.new_bucket(), "in", "d.jsonl")
    put(server, url, original)
    out = tmp_path / "out"
    cfg = job(url, tiny_folder, out, dataset={"window_rows": 4}, flush_rows=1)  # type: ignore[arg-type]
    edit = original.replace(b"quick", b"QUICK")  # the same size: only the version tells
    factory = AfterFirstWindow(tiny_llm, lambda: put(server, url, edit))
    with pytest.raises(JobStoppedError, match=stopped(url, "it was modified or replaced")):
        run_job(cfg, factory)
    assert not (out / "completions.parquet").exists()  # the job did not finish on a mix
    assert saved_indices(out) == [0, 1, 2, 3] and factory.windows == 1
    put(server, url, original)  # restored
    if server.scheme == "gs":  # a new generation: another input as far as the job can tell
        with pytest.raises(JobConfigError, match=f"different job .*{re.escape(url)}"):
            run_job(cfg, lambda *a, **k: tiny_llm)
        return
    result = run_job(cfg, lambda *a, **k: tiny_llm)  # the same ETag: the job resumes
    assert (result.rows_resumed, result.rows_generated) == (4, 8)
    run_job(job(tmp_path / "d.jsonl", tiny_folder, tmp_path / "clean"), lambda *a, **k: tiny_llm)
    clean = [{k: r[k] for k in COMPARED} for r in table(tmp_path / "clean")]
    assert [{k: r[k] for k in COMPARED} for r in table(out)] == clean


@pytest.mark.parametrize(
    ("data", "out", "what", "read"),
    [
        ("D/", "D", "folder", [0, 1]),  # would read its own job.json and shards as input
        ("D", "D/out", "folder", [0, 1]),
        ("D/sub", "D/", "folder", [1]),  # holds the input prefix
        ("D/*.jsonl", "D", "folder", [0]),  # a glob's prefix
        ("D/a.jsonl", "D", "file", [0]),  # could write over it
    ],
)
def test_an_output_dir_that_overlaps_the_input_prefix_is_refused(
    s3_env: StorageServer, tiny_folder: Path, data: str, out: str, what: str, read: list[int]
) -> None:
    root = s3_env.url(s3_env.new_bucket())
    inputs = [f"{root}/D/a.jsonl", f"{root}/D/sub/a.jsonl"]
    for url in inputs:
        put(s3_env, url, jsonl([{"prompt": "hi"}, {"prompt": "yo"}]))
    cfg = job(f"{root}/{data}", tiny_folder, f"{root}/{out}")  # type: ignore[arg-type]
    with pytest.raises(JobConfigError, match=f"output_dir={root}/{out} overlaps the input {what}"):
        run_job(cfg, llm_factory=never)
    assert s3_env.keys(root) == inputs  # nothing written
    beside = job(f"{root}/{data}", tiny_folder, f"{root}/elsewhere")  # type: ignore[arg-type]
    assert plan_job(beside).info.files == tuple(inputs[i] for i in read)
