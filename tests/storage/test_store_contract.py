"""The Store contract (batchpage/storage/store.py) on every store: local files, S3 (moto's
server) and GCS (the emulator). What a store wrote is read back through an independent client
(the file system, boto3, google-cloud-storage)."""

from __future__ import annotations

import threading

import pytest

from batchpage.storage import Stores
from batchpage.storage.objects import READ_BLOCK, WRITE_BLOCK
from tests.storage.conftest import S3_PART, StoreCase
from tests.storage.flaky_proxy import FlakyProxy


class Boom(Exception):
    pass


def test_write_stream_is_whole_or_absent(case: StoreCase) -> None:
    store, path = case.store, case.store.join(case.root, "part.bin")
    # Past a part of the store's uploads: a multipart upload on S3, a resumable one on GCS.
    data = bytes(range(256)) * ((WRITE_BLOCK + S3_PART) // 256)
    with pytest.raises(Boom), store.write_stream(path) as f:
        f.write(data)
        f.write(data)
        raise Boom
    assert case.keys(case.root) == []
    assert not store.exists(path)
    if case.name == "s3":
        bucket = store._bucket(path)
        assert case.server.pending_uploads(bucket) == []  # aborted, not left to bill

    with store.write_stream(path) as f:
        f.write(data)
        f.write(b"tail")
    assert case.read(path) == data + b"tail"
    assert store.info(path).size == len(data) + 4


def test_an_exception_leaves_the_old_bytes(case: StoreCase) -> None:
    store, path = case.store, case.store.join(case.root, "keep.txt")
    store.write_bytes(path, b"old")
    with pytest.raises(Boom), store.write_stream(path) as f:
        f.write(b"new")
        raise Boom
    assert case.read(path) == b"old"


def test_remove_leftovers(case: StoreCase) -> None:
    store, root = case.store, case.root
    for name in ("a.parquet", ".a.parquet.tmp", "sub/.b.tmp", "sub/deep/.c.tmp", "sub/b.parquet"):
        store.write_bytes(store.join(root, name), b"x")
    killed = store.join(root, "sub", "unfinished.parquet")
    if case.name == "s3":  # a writer killed mid-upload: parts sent, never completed
        client, bucket = case.server.client(), store._bucket(root)
        key = killed.partition(f"{bucket}/")[2]
        up = client.create_multipart_upload(Bucket=bucket, Key=key)
        client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"p" * S3_PART
        )
        assert case.server.pending_uploads(bucket) == [key]

    removed = store.remove_leftovers(root, (".*.tmp",))

    expected = [store.join(root, ".a.parquet.tmp"), store.join(root, "sub", ".b.tmp")]
    if case.name == "s3":
        expected.append(killed)
        assert case.server.pending_uploads(store._bucket(root)) == []
    assert sorted(removed) == sorted(expected)
    left = [store.join(root, n) for n in ("a.parquet", "sub/b.parquet", "sub/deep/.c.tmp")]
    assert case.keys(root) == sorted(left)


def test_create_bytes_is_exclusive(case: StoreCase) -> None:
    store = case.store
    rounds, writers = (20, 4) if case.name == "local" else (8, 4)
    for r in range(rounds):
        path = store.join(case.root, f"race-{r}")
        won: list[int] = []
        barrier = threading.Barrier(writers)

        def create(
            i: int, path: str = path, won: list[int] = won, gate: threading.Barrier = barrier
        ) -> None:
            gate.wait()
            if store.create_bytes(path, f"writer {i}".encode()):
                won.append(i)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1, f"round {r}: {len(won)} writers created {path}"
        assert case.read(path) == f"writer {won[0]}".encode()
    path = store.join(case.root, "race-0")
    before = case.read(path)
    assert store.create_bytes(path, b"late") is False
    assert case.read(path) == before


def test_info_version_changes_on_rewrite(case: StoreCase) -> None:
    store, path = case.store, case.store.join(case.root, "f.json")
    with pytest.raises(FileNotFoundError):
        store.info(path)
    assert not store.exists(path)
    store.write_bytes(path, b"first")
    one = store.info(path)
    assert (one.path, one.size) == (path, len(case.read(path)))
    store.write_bytes(path, b"second!")
    two = store.info(path)
    assert two.size == len(b"second!") and two.version != one.version
    assert store.info(path).version == two.version  # stable while unchanged
    with pytest.raises(FileNotFoundError):
        store.info(case.root)  # a folder or prefix is not a file
    assert store.is_dir(case.root) and not store.is_dir(path)


def test_files_under_and_glob(case: StoreCase) -> None:
    store, root = case.store, case.root
    names = ["a/1.jsonl", "a/b/2.jsonl", "a/.hidden", "a/.w.tmp", "other/3.jsonl", "a/b/4.csv"]
    for i, name in enumerate(names):
        store.write_bytes(store.join(root, name), b"x" * (i + 1))
    listed = store.files_under(store.join(root, "a"))
    reference = [k for k in case.keys(store.join(root, "a")) if not k.endswith(".w.tmp")]
    assert [i.path for i in listed] == reference
    assert [i.size for i in listed] == [len(case.read(k)) for k in reference]
    assert [i.version for i in listed] == [store.info(k).version for k in reference]
    assert store.files_under(store.join(root, "none")) == []

    assert store.glob(store.join(root, "a", "*.jsonl")) == [store.join(root, "a/1.jsonl")]
    assert store.glob(store.join(root, "**", "*.jsonl")) == [
        store.join(root, n) for n in ("a/1.jsonl", "a/b/2.jsonl", "other/3.jsonl")
    ]
    assert store.glob(store.join(root, "*", "*.tmp")) == []


def test_digest_names_size_and_change(case: StoreCase) -> None:
    store, path = case.store, case.store.join(case.root, "in.parquet")
    store.write_bytes(path, b"abcd")
    first = store.digest(path)
    assert first[:2] == ["in.parquet", len(case.read(path))]
    assert store.digest(path) == first
    store.write_bytes(path, b"wxyz")  # same size, other bytes
    assert store.digest(path) != first


def test_delete_and_move_aside(case: StoreCase) -> None:
    store = case.store
    path = store.join(case.root, "shard-1.parquet")
    store.write_bytes(path, b"damaged")
    moved = store.move_aside(path, "shard-1.parquet.bad")
    assert moved == store.join(case.root, "shard-1.parquet.bad")
    assert case.keys(case.root) == [moved]
    assert case.read(moved) == b"damaged"
    store.delete(moved)
    store.delete(moved)  # a missing file is no error
    assert case.keys(case.root) == []


def test_open_read_streams(remote: StoreCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the first line of a large object fetches about one read block, not the object;
    the reader seeks."""
    store, path = remote.store, remote.store.join(remote.root, "big.jsonl")
    lines = [f'{{"id": {i}, "prompt": "{"p" * 100}"}}\n'.encode() for i in range(300_000)]
    data = b"".join(lines)
    assert len(data) > 8 * READ_BLOCK
    store.write_bytes(path, data)
    with FlakyProxy(remote.server.endpoint) as proxy:
        for name, value in remote.server.endpoint_at(proxy.endpoint).items():
            monkeypatch.setenv(name, value)
        through = Stores().store_for(path)
        with through.open_read(path) as f:
            assert f.readline() == lines[0]
            head_bytes = proxy.counts.bytes_out
            f.seek(len(data) - len(lines[-1]))
            assert f.read() == lines[-1]
            assert f.seekable()
    # readline asks for one block and the readahead cache fetches one more (plus the metadata)
    assert head_bytes <= 2 * READ_BLOCK + 2**16 < len(data) / 4
    assert remote.read(path) == data


def test_a_missing_bucket_names_the_fix(remote: StoreCase) -> None:
    store = remote.store
    url = remote.server.url("no-such-bucket-here", "run", "x.parquet")
    for call in (lambda: store.info(url), lambda: store.write_bytes(url, b"x")):
        with pytest.raises(Exception) as e:
            call()
        assert type(e.value).__name__ == "StorageError"
        assert "no-such-bucket-here" in str(e.value) and "create it" in str(e.value)
