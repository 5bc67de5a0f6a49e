"""A dataset's files as the readers see them: listed, opened and named through its `Store`, so
that a local path and a URL (s3://, gs://, ...) go through the same reading code.

Everything here streams: a file is opened for reading as it goes (an object store's reader
fetches ranges as they are read), never downloaded whole first. Errors of the store (a missing
bucket or object, access denied, a client that is not installed) become one-line
`DatasetError`s naming the path and the fix (`storage_error`).
"""

from __future__ import annotations

import contextlib
import gzip
import io
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import pyarrow.parquet as pq

from batchpage.storage import StorageError, Store, Stores, url_scheme

# Bytes taken from an object store's reader at a time under the line reader (which caches the
# blocks it fetches): a short line then costs neither a request nor a copy of a block.
_READ_BUFFER = 1 << 16
# What each store's credentials and endpoint are set with, for the messages.
_SETTINGS = {
    "s3": "AWS_ENDPOINT_URL, AWS_PROFILE or storage.s3={...}",
    "gs": "STORAGE_EMULATOR_HOST, GOOGLE_APPLICATION_CREDENTIALS or storage.gs={...}",
    "az": "AZURE_STORAGE_CONNECTION_STRING or storage.az={...}",
}
_SCHEME_GROUPS = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}


class DatasetError(ValueError):
    """The dataset cannot be read at all; the message names the problem and the fix."""


def store_of(path: str, store: Store | None = None) -> Store:
    """`store` when given, else the one the path's form calls for (default storage settings;
    credentials still come from each store's own chain)."""
    return store if store is not None else Stores().store_for(str(path))


def is_local(store: Store) -> bool:
    return store.scheme == "file"


def sort_paths(paths: Sequence[str]) -> list[str]:
    """Paths in reading order: compared part by part ("a/x" before "a-b/y"), as pathlib sorts
    them, so that a local input's rows keep the indices (and resumes) they had."""
    return sorted(paths, key=lambda p: str(p).split("/"))


def data_files_under(store: Store, folder: str) -> list[str]:
    """The files below a folder or prefix, in reading order, without hidden or temporary ones
    and Spark-style markers (a name starting with "." or "_" anywhere below the folder)."""
    depth = len(_parts(folder))
    found = [info.path for info in store.files_under(folder)]
    visible = [f for f in found if not any(p.startswith((".", "_")) for p in _parts(f)[depth:])]
    return sort_paths(visible)


def glob_files(store: Store, pattern: str) -> list[str]:
    """The files a glob matches (unsorted). As in a shell (and Python's glob, which local paths
    go through), a wildcard matches no name that starts with "." unless the pattern spells the
    dot: object stores' globs would also list hidden files."""
    parts = _parts(pattern)
    base = next((i for i, p in enumerate(parts) if any(ch in p for ch in "*?[")), len(parts))
    found = store.glob(pattern)
    if any(p.startswith(".") for p in parts[base:]):
        return found
    return [f for f in found if not any(p.startswith(".") for p in _parts(f)[base:])]


def _parts(path: str) -> list[str]:
    return [p for p in str(path).split("/") if p not in ("", ".")]


@contextlib.contextmanager
def open_binary(store: Store, path: str) -> Iterator[BinaryIO]:
    """A buffered binary reader of a file, decompressed when its name ends in .gz; closed (the
    store's reader too) when the block ends. Bytes, not text: each line is decoded on its own,
    so one line of bad UTF-8 is that row's error instead of replaced characters or a failed
    job. `readline(limit)` works on it whatever the store's reader supports."""
    raw = store.open_read(path)
    try:
        buffered = raw
        if not isinstance(raw, io.BufferedIOBase):
            buffered = io.BufferedReader(raw, buffer_size=_READ_BUFFER)  # type: ignore[arg-type]
        if store.name(path).lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=buffered, mode="rb") as unzipped:
                yield unzipped  # type: ignore[misc]
        else:
            yield buffered
    finally:
        raw.close()


@contextlib.contextmanager
def open_parquet(store: Store, path: str) -> Iterator[pq.ParquetFile]:
    """A Parquet file's reader, which fetches its footer and then the row groups it is asked
    for; closed when the block ends, so that an input of many files holds one open at a time."""
    raw = store.open_read(path)
    try:
        parquet = pq.ParquetFile(raw)
        try:
            yield parquet
        finally:
            parquet.close()
    finally:
        raw.close()


def storage_error(path: str, error: OSError) -> DatasetError:
    """The one-line error for a dataset path the store cannot read: missing (no such bucket,
    object or prefix), access denied, or the store unusable (its own message names the fix)."""
    scheme = url_scheme(path)
    if scheme is None:  # a local file: the OS's words are the clearest
        return DatasetError(f"dataset.path={path!r} cannot be read: {error}")
    settings = _SETTINGS.get(_SCHEME_GROUPS.get(scheme, scheme), f"storage options of {scheme}")
    if isinstance(error, PermissionError):
        return DatasetError(
            f"dataset.path={path!r}: access denied; give the job's credentials read access to "
            f"it, or set the credentials it should use ({settings})"
        )
    if isinstance(error, FileNotFoundError):
        return DatasetError(
            f"dataset.path={path!r}: no such object or prefix; check the key (a folder's URL "
            f"reads every object under it, a glob the objects it matches), and that the job "
            f"reaches the store that holds it ({settings})"
        )
    if isinstance(error, StorageError):  # its message names the URL and the fix
        return DatasetError(f"dataset.path: {error}")
    return DatasetError(f"dataset.path={path!r} cannot be read: {error} (check {settings})")
