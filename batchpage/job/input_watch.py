"""Inputs that change while the job reads them: found, so the job stops instead of finishing on
a mix of the old rows and the new ones (or on fewer rows than the file held).

The job's identity holds each input file's digest, taken before the model loads. InputWatch
records every file's size and version when the job starts (through its `Store`: a local file's
mtime and inode, an object's ETag or generation); `check` compares them at each window (before
its rows are generated, so rows read after a change are never written) and at the end, and
`check_digests` takes the digests again before the final merge: a local edit that kept the size
and the mtime is caught there. A file whose state changed but whose digest did not (a `touch`, a
copy of the same bytes) is no change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from batchpage.job.plan import JobStoppedError
from batchpage.storage import ObjectInfo, Store, Stores

# Inputs of more objects than this in one store are watched with one listing of the folder
# that holds them all, rather than one request per object at every window.
_LIST_OVER = 32


class FileState(NamedTuple):
    size: int
    version: str  # the store's: changes whenever the bytes may have


States = dict[str, FileState | None]


def file_states(store: Store, entry: str) -> States:
    """Each file of an input entry (a file, or every file under a folder): its state, None if
    it is gone."""
    try:
        info = store.info(entry)  # one request for an object: it is asked at every window
    except FileNotFoundError:
        if store.is_dir(entry):
            return {i.path: FileState(i.size, i.version) for i in store.files_under(entry)}
        return {entry: None}
    return {entry: FileState(info.size, info.version)}


class InputWatch:
    """The input files of one run of a job. `output_dir` is named in the message; `stores`:
    the job's (None: default storage settings)."""

    def __init__(
        self,
        files: Sequence[str],
        digests: Mapping[str, Any],
        output_dir: str | Path,
        stores: Stores | None = None,
    ) -> None:
        self.entries = [str(f) for f in files]
        self.digests = dict(digests)
        self.output_dir = output_dir
        self.stores = stores or Stores()
        self.states = self._all_states()

    def check(self) -> None:
        """Raise JobStoppedError naming the first input whose size or version changed, or
        that appeared or went away since the job started, unless its digest is the job's."""
        for entry, now in self._all_states().items():
            before = self.states[entry]
            if now == before:
                continue
            for f in sorted(set(before) | set(now)):
                old, new = before.get(f), now.get(f)
                if old != new and not self._same_bytes(entry):
                    raise self._changed(f, _what_changed(old, new))
            self.states[entry] = now  # the same bytes: watch the file as it is now

    def _all_states(self) -> dict[str, States]:
        """Every entry's states: one request per entry, or for many objects of one store a
        listing of the folder they share (what is not listed there is gone)."""
        by_store: dict[str, list[str]] = {}
        for entry in self.entries:
            by_store.setdefault(self.stores.store_for(entry).scheme, []).append(entry)
        states: dict[str, States] = {}
        for entries in by_store.values():
            store = self.stores.store_for(entries[0])
            if store.scheme == "file" or len(entries) <= _LIST_OVER:
                states |= {e: file_states(store, e) for e in entries}
                continue
            listed = {i.path: FileState(i.size, i.version) for i in _listing(store, entries)}
            states |= {e: {e: listed.get(e)} for e in entries}
        return states

    def _same_bytes(self, entry: str) -> bool:
        expected = self.digests.get(entry)
        try:
            return expected is not None and self.stores.store_for(entry).digest(entry) == expected
        except OSError:  # gone, or unreadable now
            return False

    def check_digests(self) -> None:
        """Take every input's digest again; raise JobStoppedError if one differs from the job's
        (the one its results are filed under)."""
        for entry in self.entries:
            expected = self.digests.get(entry)
            if expected is not None and not self._same_bytes(entry):
                raise JobStoppedError(
                    f"input file {entry} changed while the job ran (its contents differ from "
                    "when the job started, though its size and mtime are the same), so the rows "
                    f"saved in {self.output_dir} may mix the old file and the new: rerun with "
                    "overwrite=true to start over"
                )

    def _changed(self, path: str, what: str) -> JobStoppedError:
        return JobStoppedError(
            f"input file {path} changed while the job ran ({what}); the job stopped, and the "
            f"rows saved in {self.output_dir} were made from the file as it was. Restore it and "
            "rerun to resume, or rerun with overwrite=true to start over on the new file"
        )


def _listing(store: Store, entries: Sequence[str]) -> list[ObjectInfo]:
    """The files under the folder all `entries` lie in (none if that folder is gone)."""
    parents = [store.parent(e).split("/") for e in entries]
    shared = parents[0]
    for p in parents[1:]:
        while p[: len(shared)] != shared:
            shared = shared[:-1]
    with contextlib.suppress(FileNotFoundError):
        return store.files_under("/".join(shared))
    return []


def _what_changed(old: FileState | None, new: FileState | None) -> str:
    if old is None:
        return "it appeared"
    if new is None:
        return "it was removed"
    if old.size != new.size:
        return f"size {old.size:,} -> {new.size:,} bytes"
    return "it was modified or replaced"
