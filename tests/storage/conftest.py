"""The stores the storage tests run on: local files, S3 (moto's server) and GCS (the emulator),
each with an independent reference reader (the file system, boto3, google-cloud-storage)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchpage.storage import StorageConfig, Store, Stores
from tests.storage_servers import StorageServer

# s3fs's smallest write block (S3's smallest part): a write past it starts a multipart upload.
S3_PART = 5 * 2**20


@dataclass
class StoreCase:
    """A store, a fresh folder in it, and the reference's view of the same bytes."""

    name: str
    store: Store
    root: str
    read: Callable[[str], bytes]
    keys: Callable[[str], list[str]]
    server: StorageServer | None = None


def read_local(path: str) -> bytes:
    return Path(path).read_bytes()


def local_keys(folder: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files)


def make_case(name: str, request: pytest.FixtureRequest, tmp_path: Path, **opts: Any) -> StoreCase:
    if name == "local":
        root = str(tmp_path / "root")
        os.makedirs(root)
        return StoreCase(name, Stores().store_for(root), root, read_local, local_keys)
    server: StorageServer = request.getfixturevalue("s3_env" if name == "s3" else "gcs_env")
    config = StorageConfig(**opts)
    root = server.url(server.new_bucket(), "root")
    return StoreCase(name, Stores(config).store_for(root), root, server.read, server.keys, server)


@pytest.fixture(params=["local", "s3", "gcs"])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> StoreCase:
    """Each store in turn; S3 writes in parts of S3_PART bytes (multipart past that)."""
    return make_case(request.param, request, tmp_path, s3={"default_block_size": S3_PART})


@pytest.fixture(params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> StoreCase:
    """Each object store in turn."""
    return make_case(request.param, request, tmp_path)
