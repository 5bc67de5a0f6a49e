"""Inputs at a URL (issue #70 item 2): the same Parquet, JSONL (.jsonl.gz too), CSV and OpenAI
Batch data uploaded to the S3 server (moto) and the GCS emulator reads as the local copy does,
row for row, as one object, a prefix and a glob; streamed (the first window fetches a part of a
large object); fingerprinted by the objects' versions; and a missing bucket or object, or an HF
dataset at a URL, is one line that says what to do. The local copy, read as before this change,
is the reference; the objects are uploaded with the services' own clients (boto3,
google-cloud-storage). Local inputs keep their fingerprints, and an input of many files holds
one open at a time."""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.data import DatasetError, DatasetSpec, iter_rows, iter_windows, validate
from batchpage.fileio import file_digest
from batchpage.storage import Stores
from batchpage.storage import objects as object_store
from tests.storage.flaky_proxy import FlakyProxy
from tests.storage_servers import StorageServer, split_url


@pytest.fixture(params=["s3", "gcs"])
def server(request: pytest.FixtureRequest) -> StorageServer:
    """Each object store's server in turn, with its environment set for the test."""
    return request.getfixturevalue("s3_env" if request.param == "s3" else "gcs_env")


def put(server: StorageServer, url: str, data: bytes) -> None:
    """Upload through the service's own client, not through batchpage's store."""
    bucket, key = split_url(url)
    if server.scheme == "s3":
        server.client().put_object(Bucket=bucket, Key=key, Body=data)
    else:
        server.client().bucket(bucket).blob(key).upload_from_string(data)


def upload(server: StorageServer, folder: Path) -> str:
    """Every file under `folder` to a prefix of a new bucket, keyed by its path below `folder`;
    the prefix's URL."""
    root = server.url(server.new_bucket(), "in", "data")
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            put(server, f"{root}/{f.relative_to(folder).as_posix()}", f.read_bytes())
    return root


def jsonl(records: list[Any]) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per format, each of two files (and files a prefix must skip)."""
    root = tmp_path_factory.mktemp("inputs")
    for name in ("parquet", "jsonl", "csv", "batch"):
        (root / name).mkdir()
    when = datetime.datetime(2024, 5, 1, 12, 30)
    records = [
        {
            "prompt": f"Say {i} in words",
            "id": f"r{i}",
            "max_tokens": 4 + i,
            "meta": {"k": i, "tags": [f"t{i}", "x"]},
            "when": when + datetime.timedelta(hours=i),
        }
        for i in range(10)
    ]
    table = pa.Table.from_pylist(records)
    pq.write_table(table.slice(0, 6), root / "parquet" / "a.parquet", row_group_size=2)
    pq.write_table(table.slice(6), root / "parquet" / "b.parquet")
    (root / "parquet" / "_SUCCESS").write_bytes(b"")
    pq.write_table(table.slice(0, 1), root / "parquet" / ".hidden.parquet")
    plain = [{**r, "when": r["when"].isoformat()} for r in records]
    lines = [*plain[:4], "{not json", {"prompt": None, "id": "null-prompt"}, *plain[4:7]]
    (root / "jsonl" / "a.jsonl").write_bytes(jsonl(lines) + b'{"prompt": "\xff"}\n')
    (root / "jsonl" / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(plain[7:])))
    csv_rows = [f'"Say {i}, please",r{i},0.{i}' for i in range(8)]
    (root / "csv" / "a.csv").write_text("prompt,id,temperature\n" + "\n".join(csv_rows[:5]))
    (root / "csv" / "b.csv").write_text("prompt,id,temperature\n" + "\n".join(csv_rows[5:]))
    batch = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3},
        }
        for i in range(5)
    ]
    (root / "batch" / "requests.jsonl").write_bytes(jsonl([*batch, {"custom_id": "bad"}]))
    return root


def read_all(path: str) -> tuple[Any, list[dict[str, Any]]]:
    spec = DatasetSpec(path=path, window_rows=3)
    info = validate(spec, Stores())
    return info, [dataclasses.asdict(r) for r in iter_rows(spec, info, Stores())]


# (format folder, what follows the folder: one object, the prefix, a glob), rows expected
CASES = [
    ("parquet", "a.parquet", 6),
    ("parquet", "", 10),
    ("parquet", "*.parquet", 10),
    ("jsonl", "a.jsonl", 10),
    ("jsonl", "b.jsonl.gz", 3),
    ("jsonl", "", 13),
    ("jsonl", "*.jsonl*", 13),
    ("csv", "a.csv", 5),
    ("csv", "", 8),
    ("csv", "?.csv", 8),
    ("batch", "requests.jsonl", 6),
    ("batch", "", 6),
    ("batch", "*.jsonl", 6),
]


@pytest.mark.parametrize(("kind", "tail", "rows"), CASES)
def test_an_input_at_a_url_reads_as_its_local_copy(
    server: StorageServer, inputs: Path, kind: str, tail: str, rows: int
) -> None:
    url_root = upload(server, inputs / kind)
    local, expected = read_all(str(inputs / kind / tail))
    info, got = read_all(f"{url_root}/{tail}")
    assert len(expected) == rows and got == expected  # every Row field, errors included
    for field in ("format", "columns", "num_rows", "id_column", "prompt_column", "carried"):
        assert getattr(info, field) == getattr(local, field), field
    assert info.carried_schema == local.carried_schema
    assert [f.rpartition("/")[2] for f in info.files] == [Path(f).name for f in local.files]
    assert all(f.startswith(f"{url_root}/") for f in info.files)
    # What decides the rows is the same; each file's entry is its object's name, size, version.
    same = {k: v for k, v in info.fingerprint.items() if k != "files"}
    assert same == {k: v for k, v in local.fingerprint.items() if k != "files"}
    sizes = [(Path(f).name, Path(f).stat().st_size) for f in local.files]
    assert [tuple(d[:2]) for d in info.fingerprint["files"].values()] == sizes


def test_a_local_inputs_fingerprint_is_as_before(tmp_path: Path, monkeypatch) -> None:
    """Local files keep the fingerprint earlier output_dirs were filed under: each file by its
    path as pathlib spells it and fileio.file_digest, in pathlib's order."""
    monkeypatch.chdir(tmp_path)
    for sub in ("d/a-b", "d/a"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "x.jsonl").write_bytes(jsonl([{"prompt": sub}]))
    both = [Path("d/a/x.jsonl"), Path("d/a-b/x.jsonl")]  # part by part: "a" before "a-b"
    one = Path("d//a/../a-b/x.jsonl")
    for spelled, files in (
        ("./d/", both),
        ("d", both),
        ("./d/**/*.jsonl", both),
        (str(one), [one]),
    ):
        info = validate(DatasetSpec(path=spelled))
        assert info.fingerprint["files"] == {str(f): file_digest(f) for f in files}, spelled
        assert list(info.files) == [str(f) for f in files]


def test_the_fingerprint_follows_the_objects_version(server: StorageServer) -> None:
    url = server.url(server.new_bucket(), "p", "d.jsonl")
    put(server, url, jsonl([{"prompt": "one"}, {"prompt": "two"}]))
    first = validate(DatasetSpec(path=url)).fingerprint
    assert validate(DatasetSpec(path=url)).fingerprint == first
    put(server, url, jsonl([{"prompt": "One"}, {"prompt": "Two"}]))  # the same size
    changed = validate(DatasetSpec(path=url)).fingerprint
    assert changed["files"] != first["files"]
    assert changed["files"][url][:2] == first["files"][url][:2]  # name and size: the version
    assert {**changed, "files": None} == {**first, "files": None}


def test_the_first_window_of_a_large_object_fetches_a_part_of_it(
    server: StorageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows stream: reading the first one fetches a few blocks of the object, not all of it;
    and validate's pass over every line holds a bounded part of it in memory at a time."""
    monkeypatch.setattr(object_store, "READ_BLOCK", 1 << 18)
    records = [{"prompt": f"row {i} " + "x" * 300, "k": i} for i in range(60_000)]
    data = jsonl(records)
    url = server.url(server.new_bucket(), "big.jsonl")
    put(server, url, data)
    spec = DatasetSpec(path=url, window_rows=16)
    stores = Stores()
    info = validate(spec, stores)  # once with cold clients: their first use loads their models
    tracemalloc.start()
    try:
        assert validate(spec, stores) == info
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.num_rows == len(records) and peak < len(data) / 4
    with FlakyProxy(server.endpoint) as proxy:
        for name, value in server.endpoint_at(proxy.endpoint).items():
            monkeypatch.setenv(name, value)
        windows = iter_windows(spec, info, Stores())
        first = next(windows)
        windows.close()
        fetched = bytes_sent(proxy)
    assert [r.prompt for r in first] == [r["prompt"] for r in records[:16]]
    assert [r.extra["k"] for r in first] == list(range(16))
    assert 0 < fetched < len(data) / 4


def bytes_sent(proxy: FlakyProxy) -> int:
    """The proxy's response bytes, once its handler threads have counted all they sent (each
    counts after its write, which the client may have read already)."""
    last, deadline = -1, time.monotonic() + 10
    while (now := proxy.counts.bytes_out) != last or now == 0:
        if time.monotonic() > deadline:
            break
        last = now
        time.sleep(0.2)
    return now


def test_a_missing_bucket_object_or_match_is_one_line(server: StorageServer) -> None:
    bucket = server.new_bucket()
    put(server, server.url(bucket, "there.jsonl"), jsonl([{"prompt": "x"}]))
    cases = [
        (server.url("bp-no-such-bucket-70", "p", "d.jsonl"), "does not exist; create it"),
        (server.url(bucket, "missing.jsonl"), "no such object or prefix; check the key"),
        (server.url(bucket, "missing", "*.jsonl"), "matches no objects; check the pattern"),
        (server.url("bp-no-such-bucket-70", "p", "*.jsonl"), "does not exist; create it"),
    ]
    for url, words in cases:
        with pytest.raises(DatasetError) as e:
            validate(DatasetSpec(path=url))
        message = str(e.value)
        assert "\n" not in message and url.rpartition("/")[0] in message and words in message


def test_an_hf_dataset_at_a_url_is_refused_naming_what_works(server: StorageServer) -> None:
    bucket = server.new_bucket()
    array = server.url(bucket, "rows.json")
    put(server, array, json.dumps([{"prompt": "a"}, {"prompt": "b"}]).encode())
    lines = server.url(bucket, "rows.jsonl")
    put(server, lines, jsonl([{"prompt": "a"}]))
    saved = server.url(bucket, "saved")
    put(server, f"{saved}/state.json", b"{}")
    put(server, f"{saved}/data-00000-of-00001.arrow", b"")
    for spec in (
        DatasetSpec(path=array),
        DatasetSpec(path=lines, format="hf"),
        DatasetSpec(path=saved),
    ):
        with pytest.raises(DatasetError) as e:
            validate(spec)
        message = str(e.value)
        assert "\n" not in message and "local disk" in message, message
        assert "Parquet, JSONL (.jsonl, .jsonl.gz), CSV or OpenAI Batch" in message


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_an_input_of_many_files_holds_one_open_at_a_time(tmp_path: Path) -> None:
    """Each file is closed before the next is opened, in validate and while rows are read: with
    the process allowed a few more open files than it has, 60 files read, and none stays open."""
    import resource  # POSIX, as /proc is

    for kind in ("parquet", "jsonl", "csv"):
        (tmp_path / kind).mkdir()
    for i in range(60):
        rows = [{"prompt": f"file {i} row {j}", "k": f"{i}.{j}"} for j in range(3)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "parquet" / f"{i:02d}.parquet")
        (tmp_path / "jsonl" / f"{i:02d}.jsonl").write_bytes(jsonl(rows))
        lines = "".join(f"{r['prompt']},{r['k']}\n" for r in rows)
        (tmp_path / "csv" / f"{i:02d}.csv").write_text("prompt,k\n" + lines)
    specs = [
        DatasetSpec(path=str(tmp_path / kind), window_rows=2)
        for kind in ("parquet", "jsonl", "csv")
    ]
    validate(specs[0])  # imports and thread pools started before the count
    before = len(list(Path("/proc/self/fd").iterdir()))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 16, hard))
    try:
        read = [len(list(iter_rows(spec, validate(spec)))) for spec in specs]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert read == [180, 180, 180]
    assert len(list(Path("/proc/self/fd").iterdir())) == before
