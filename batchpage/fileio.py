"""Files that are either whole or absent, and digests that say whether a file changed.

Every file batchpage writes for later (shards, completions.parquet, run.json, job.json, the
bundled datasets, converted tokenizers) is built under a unique temporary name beside its target
and renamed into place, so a reader or a process killed mid-write never sees half a file, and two
writers never share a temporary name. The temporary name starts with "." and ends with ".tmp",
which no glob of real files matches.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yields a temporary file path beside `path`; when the block ends without an exception the
    file is fsynced and renamed onto `path` (and the rename made durable), else it is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
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
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError:
        yield None
        return
    try:
        yield tmp
        with contextlib.suppress(OSError):  # a folder of that name won the race: keep it
            os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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

    sample_bytes=None hashes every byte (blake2b streams at about 1 GB/s), so any edit is seen;
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
