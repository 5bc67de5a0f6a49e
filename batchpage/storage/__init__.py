"""Where a job's files live: local disks or object storage, behind one interface (store.py).

    stores = Stores(StorageConfig())     # once per job
    store = stores.store_for(path)       # LocalStore for a path, ObjectStore for a URL

A URL is `<scheme>://...` with a scheme fsspec knows (s3, gs, az, abfs, memory, ...); anything
else, including a Windows drive letter, is a local path.
"""

from __future__ import annotations

import re

from batchpage.storage.config import StorageConfig, redacted
from batchpage.storage.local import LocalStore
from batchpage.storage.store import (
    JobLock,
    LockHeldError,
    ObjectInfo,
    OutputLostError,
    StorageError,
    Store,
    safe_url,
)

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+)://")
# URL schemes and the package of their client, which the `cloud` extra installs.
CLIENTS = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs",
    "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs",
}  # fmt: skip


def url_scheme(path: str) -> str | None:
    """The scheme of a URL ("s3"), None for a local path (file:// counts as local)."""
    m = _URL.match(str(path))
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(path: str) -> bool:
    return url_scheme(path) is not None


class Stores:
    """The stores of one job, made on first use and kept (one client per scheme)."""

    def __init__(self, config: StorageConfig | None = None) -> None:
        self.config = config or StorageConfig()
        self._made: dict[str, Store] = {}

    def store_for(self, path: str) -> Store:
        """The store that holds `path`. StorageError when its client is not installed."""
        scheme = url_scheme(path) or "file"
        if scheme not in self._made:
            self._made[scheme] = self._make(scheme)
        return self._made[scheme]

    def _make(self, scheme: str) -> Store:
        if scheme == "file":
            return LocalStore()
        from batchpage.storage.objects import ObjectStore

        return ObjectStore.for_scheme(scheme, self.config)


def local_path(path: str) -> str:
    """A local path with a file:// prefix removed."""
    return path[len("file://") :] if str(path).lower().startswith("file://") else path


__all__ = [
    "CLIENTS",
    "JobLock",
    "LocalStore",
    "LockHeldError",
    "ObjectInfo",
    "OutputLostError",
    "Store",
    "StorageConfig",
    "StorageError",
    "Stores",
    "is_url",
    "local_path",
    "redacted",
    "safe_url",
    "url_scheme",
]
