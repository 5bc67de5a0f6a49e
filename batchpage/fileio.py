"""Files that are either whole or absent, and digests that say whether a file changed.

Every file batchpage writes for later (shards, completions.parquet, run.json, job.json, the
bundled datasets, converted tokenizers) is built under a unique temporary name beside its target
and renamed into place, so a reader or a process killed mid-write never sees half a file, and two
writers never share a temporary name. The temporary name starts with "." and ends with ".tmp",
which no glob of real files matches. Files and folders get the mode of any file the process
creates (0644 and 0755 under the usual umask 022), not tempfile's private 0600 and 0700: results
are meant to be shared as the user's umask says.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

_NAME_TRIES = 100  # random names collide only if something else floods the folder


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temporary file path beside `path`; when the block ends without an exception the
    file is fsynced and renamed onto `path` (and the rename made durable), else it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_temp(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path | None]:
    """Yields a fresh temporary folder beside `path` that becomes `path` when the block ends.
    When `path` already exists (another process got there first) the new folder is dropped.
    Yields None when the parent cannot be written: the caller skips saving."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _unique_temp(path, lambda p: os.mkdir(p, 0o777))
    except OSError:
        yield None
        return
    try:
        yield tmp
        with contextlib.suppress(OSError):  # a folder of that name won the race: keep it
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def unique_temp(path: Path) -> Path:
    """A new empty file ".<name>.<random>.tmp" beside `path` (whose folder must exist), made
    with the mode any file of the process gets; the caller removes it."""
    return _unique_temp(path, lambda p: os.close(os.open(p, _NEW_FILE, 0o666)))


def _unique_temp(path: Path, create: Callable[[Path], None]) -> Path:
    """A new ".<name>.<random>.tmp" beside `path`, made by `create` (which must fail with
    FileExistsError on a taken name). The mode given to os.open / os.mkdir is filtered by the
    umask, as for any file the process makes; tempfile's would be 0600 / 0700 whatever it is."""
    for _ in range(_NAME_TRIES):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            create(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path} after {_NAME_TRIES} tries")


def fsync_dir(folder: Path) -> None:
    # Makes a rename itself durable (power loss); harmless where directories cannot be opened.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_digest(path: Path, sample_bytes: int | None = None) -> list:
    """[name, size, hash] of a file, or [path, [digests of its files]] of a folder.

    sample_bytes=None hashes every byte with blake2b (among hashlib's fastest), so any edit is seen;
    sample_bytes=k hashes only the first and last k bytes, for multi-GB weight files that are
    replaced whole rather than edited in place.
    """
    if path.is_dir():
        return [
            str(path),
            [file_digest(f, sample_bytes) for f in sorted(path.rglob("*")) if f.is_file()],
        ]
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if sample_bytes is None or size <= 2 * sample_bytes:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        else:
            h.update(f.read(sample_bytes))
            f.seek(size - sample_bytes)
            h.update(f.read())
    return [path.name, size, h.hexdigest()]
