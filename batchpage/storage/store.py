"""The storage seam: every file a job reads or writes goes through a `Store`.

Two implementations, chosen from the path once (`batchpage.storage.Stores.store_for`):
`LocalStore` (local.py: flock, O_EXCL, rename, fsync) and `ObjectStore` (objects.py: S3, GCS,
Azure Blob and any other fsspec filesystem: conditional writes, a lease object). Callers use
paths as strings ("out/run-1/x", "s3://bucket/run-1/x") and join them with `Store.join`, never
pathlib: a URL is not a local path.

Contracts every implementation keeps (tests/storage/test_store_contract.py runs them on each):
- A write is whole or absent: a reader, or a process killed mid-write, never sees half of it.
- `create_bytes` never replaces: of two writers of one path, exactly one wins.
- `info` is cheap (one stat or one HEAD) and its `version` changes whenever the bytes may have.
- What is listed excludes the store's own temporary files (names starting with "." and ending
  with ".tmp").
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple


def safe_url(url: str) -> str:
    """A URL fit for a message: any user:secret@ part of its authority dropped."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{tail}"


class StorageError(OSError):
    """A store cannot be reached or used (missing client, bucket, permission); the message names
    the URL and the fix."""


class ObjectInfo(NamedTuple):
    """One file or object: its full path (a URL for an object), size in bytes, and a version
    that changes when its bytes may have (local: mtime_ns and inode; S3: ETag; GCS: generation)."""

    path: str
    size: int
    version: str


class JobLock(ABC):
    """Held by the one writer of an output folder for its life (local: an flock; object storage:
    a lease object with heartbeats). `check` raises OutputLostError once another job has taken
    the folder over (only a lease can be lost); `release` gives it up and is idempotent."""

    @abstractmethod
    def check(self) -> None: ...

    @abstractmethod
    def release(self) -> None: ...


class LockHeldError(StorageError):
    """Another live job holds the output folder; the message names it and what to do."""


class OutputLostError(StorageError):
    """This job's lease on its output folder expired and another job took the folder over."""


class Store(ABC):
    """Files under one kind of storage. Paths are strings in the store's own form."""

    #: "file" for local files, else the URL scheme (s3, gs, az, memory, ...).
    scheme: str

    # --- names ---------------------------------------------------------------------------------

    @abstractmethod
    def join(self, base: str, *names: str) -> str:
        """`base` and the names below it, in this store's form."""

    def name(self, path: str) -> str:
        """The last part of a path (a file's name, an object key's last segment)."""
        return path.rstrip("/").rpartition("/")[2]

    def parent(self, path: str) -> str:
        return path.rstrip("/").rpartition("/")[0]

    # --- reading -------------------------------------------------------------------------------

    @abstractmethod
    def info(self, path: str) -> ObjectInfo:
        """Size and version of one file; FileNotFoundError when there is none."""

    def exists(self, path: str) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether the path is a folder (an object store: a prefix that holds objects)."""

    @abstractmethod
    def files_under(self, folder: str) -> list[ObjectInfo]:
        """Every file below a folder or prefix, recursively, sorted by path; hidden names ("."
        first) are listed, the store's temporary files are not."""

    @abstractmethod
    def glob(self, pattern: str) -> list[str]:
        """The files (not folders) a glob matches, sorted; `**` crosses folders."""

    @abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """A seekable binary reader that fetches as it is read (no whole download first)."""

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    # --- writing -------------------------------------------------------------------------------

    @abstractmethod
    def write_stream(self, path: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A binary writer whose bytes become `path` (replacing it) only when the block ends
        without an exception; on an exception, or a kill, nothing of them is visible at `path`."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Replace `path` with `data`, whole or not at all."""
        with self.write_stream(path) as f:
            f.write(data)

    @abstractmethod
    def create_bytes(self, path: str, data: bytes) -> bool:
        """Create `path` holding `data` unless it exists: True if this call created it, False if
        the path already existed (its bytes are left as they were). Atomic against other
        writers: of any number of concurrent calls on one path, exactly one returns True."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove one file; a missing one is no error."""

    @abstractmethod
    def move_aside(self, path: str, new_name: str) -> str:
        """Rename a file beside itself (e.g. a damaged shard kept as evidence); its new path."""

    # --- the job's folder ----------------------------------------------------------------------

    @abstractmethod
    def lock(self, folder: str, lease_seconds: float) -> JobLock:
        """Take the output folder for this process; LockHeldError when a live job holds it.
        A holder that died (kill -9) never blocks: an flock dies with its process, a lease
        expires after `lease_seconds` without a heartbeat."""

    @abstractmethod
    def remove_leftovers(self, folder: str, patterns: tuple[str, ...]) -> list[str]:
        """Delete what a killed writer left in `folder` and its subfolders one level down (temp
        files matching `patterns`, unfinished multipart uploads); the paths removed. Call it
        holding the folder's lock."""

    @contextlib.contextmanager
    def scratch(self, near: str) -> Iterator[Path]:
        """A local folder for temporary files of a large merge, removed afterwards: beside
        `near` for local files (same disk), in the system's temp folder otherwise."""
        import shutil
        import tempfile

        where = self._scratch_dir(near)
        tmp = Path(tempfile.mkdtemp(prefix=".finalize.", suffix=".tmp", dir=where))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _scratch_dir(self, near: str) -> str | None:
        return None

    # --- identity ------------------------------------------------------------------------------

    @abstractmethod
    def digest(self, path: str) -> list:
        """What a job's fingerprint records of an input file: enough to tell a changed file.
        Local files: [name, size, content hash] (fileio.file_digest); objects: [name, size,
        version], the store's own checksum (ETag, generation) standing for the content."""
