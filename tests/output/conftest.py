"""Output folders for the output tests: local, or in a fresh bucket on moto's S3 server or the
GCS emulator (tests/storage_servers.py), with the store the job would use for it and an
independent reference reader (the file system, boto3, google-cloud-storage)."""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchpage.output import ResultRow
from batchpage.storage import StorageConfig, Store, Stores
from tests.storage_servers import StorageServer

# A short lease (ShardWriter takes any; a job's storage.lease_seconds is at least 5 s), so
# that tests that wait for one to expire wait little.
LEASE_S = 2.0


@dataclass
class Bucket:
    """A fresh bucket: `url(...)` names a folder in it, `store` is the job's store for it, and
    `server.read(url)` / `server.keys(url)` read it back through the reference client."""

    kind: str  # "s3" or "gcs"
    server: StorageServer
    name: str
    store: Store

    def url(self, *keys: str) -> str:
        return self.server.url(self.name, *keys)


@pytest.fixture(params=["s3", "gcs"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """Each object store in turn, with its environment set in this process."""
    server: StorageServer = request.getfixturevalue(f"{request.param}_env")
    name = server.new_bucket()
    store = Stores(StorageConfig()).store_for(server.url(name))
    return Bucket(request.param, server, name, store)


def result_rows(count: int, text_bytes: int = 0) -> list[ResultRow]:
    """Rows with what completions.parquet must carry through: errors, empty and non-ASCII text;
    `text_bytes` pads each completion (incompressible) to make a big file."""
    rng = random.Random(count)
    rows = []
    for i in range(count):
        if i % 7 == 3:
            rows.append(ResultRow.failed(i, f"id{i}", f"row {i} is bad", prompt=f"p{i}"))
            continue
        pad = base64.b64encode(rng.randbytes(text_bytes * 3 // 4)).decode()
        text = "" if i % 11 == 5 else f"out {i} é✓{pad}"
        rows.append(ResultRow(i, f"id{i}", f"p{i}", text, "stop", 3 + i, 2, i % 2, None))
    return rows


@dataclass
class Folder:
    """An output folder on one kind of storage: `url`, the job's `store` for it, and the
    reference reader (the file system, boto3 or google-cloud-storage)."""

    kind: str  # "local", "s3" or "gcs"
    url: str
    store: Store
    read: Callable[[str], bytes]
    keys: Callable[[str], list[str]]  # every file under a folder, sorted


def _local_keys(folder: str) -> list[str]:
    return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file())


@pytest.fixture(params=["local", "s3", "gcs"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> Folder:
    """A fresh output folder on each kind of storage in turn."""
    if request.param == "local":
        url = str(tmp_path / "run-1")
        store = Stores().store_for(url)
        return Folder("local", url, store, lambda p: Path(p).read_bytes(), _local_keys)
    server: StorageServer = request.getfixturevalue(f"{request.param}_env")
    url = server.url(server.new_bucket(), "run-1")
    return Folder(request.param, url, Stores().store_for(url), server.read, server.keys)
