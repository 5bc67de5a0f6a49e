"""Local files behind the storage seam: today's semantics (flock, O_EXCL, rename, fsync)."""

from __future__ import annotations

import contextlib
import glob as globlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from batchpage.fileio import atomic_path, file_digest, fsync_dir, unique_temp
from batchpage.storage.store import JobLock, LockHeldError, ObjectInfo, Store

LOCK_FILE = "job.lock"


class LocalStore(Store):
    """Files on this machine's disks (and anything mounted there)."""

    scheme = "file"

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def name(self, path: str) -> str:
        return Path(path).name

    def parent(self, path: str) -> str:
        return str(Path(path).parent)

    def info(self, path: str) -> ObjectInfo:
        st = os.stat(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is not a file")
        return ObjectInfo(str(path), st.st_size, f"{st.st_mtime_ns}:{st.st_ino}")

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def files_under(self, folder: str) -> list[ObjectInfo]:
        found = []
        for f in sorted(Path(folder).rglob("*")):
            if f.is_file() and not _is_temp(f.name):
                with contextlib.suppress(FileNotFoundError):  # gone since it was listed
                    found.append(self.info(str(f)))
        return found

    def glob(self, pattern: str) -> list[str]:
        hits = globlib.glob(os.path.expanduser(pattern), recursive=True)
        return sorted(p for p in hits if os.path.isfile(p) and not _is_temp(Path(p).name))

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    @contextlib.contextmanager
    def write_stream(self, path: str) -> Iterator[BinaryIO]:
        with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
            yield f

    def create_bytes(self, path: str, data: bytes) -> bool:
        # Written whole under a temporary name, then linked into place: a link never replaces
        # an existing name, so the create is both exclusive and whole-or-absent.
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = unique_temp(target)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            fsync_dir(target.parent)
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, path: str) -> None:
        p = Path(path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)

    def move_aside(self, path: str, new_name: str) -> str:
        target = Path(path).with_name(new_name)
        os.replace(path, target)
        return str(target)

    def lock(self, folder: str, lease_seconds: float) -> JobLock:
        return _FlockLock.take(Path(folder))

    def remove_leftovers(self, folder: str, patterns: tuple[str, ...]) -> list[str]:
        root = Path(folder)
        places = [root, *(p for p in root.iterdir() if p.is_dir())] if root.is_dir() else []
        removed = []
        for place in places:
            for pattern in patterns:
                for p in place.glob(pattern):
                    self.delete(str(p))
                    removed.append(str(p))
        return removed

    def _scratch_dir(self, near: str) -> str | None:
        return near if os.path.isdir(near) else None

    def digest(self, path: str) -> list:
        return file_digest(Path(path))


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


class _FlockLock(JobLock):
    """An exclusive flock on <folder>/job.lock: the OS drops it when the process dies, so a
    kill -9 never leaves a stale lock. Not POSIX (no fcntl): no guard."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def take(cls, folder: Path) -> _FlockLock:
        try:
            import fcntl
        except ImportError:
            return cls(None)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise LockHeldError(f"a process of this machine holds {folder / LOCK_FILE}") from None
        return cls(fd)

    def check(self) -> None:
        return None  # an flock cannot be taken from a live holder

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the fd drops the flock
            self._fd = None
