"""Inputs that change while the job reads them: found, so the job stops instead of finishing on
a mix of the old rows and the new ones (or on fewer rows than the file held).

The job's identity holds each input file's digest, taken before the model loads. InputWatch
records every file's size, mtime and inode when the job starts; `check` compares them at each
window (before its rows are generated, so rows read after a change are never written) and at
the end, and `check_digests` takes the digests again before the final merge: an edit that kept
the size and the mtime is caught there. A file whose state changed but whose digest did not (a
`touch`, a copy of the same bytes) is no change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from batchpage.fileio import file_digest
from batchpage.job.plan import JobStoppedError


class FileState(NamedTuple):
    size: int
    mtime_ns: int
    inode: int


def file_states(entry: Path) -> dict[Path, FileState | None]:
    """Each file of an input entry (a file, or every file under a folder): its state, None if
    it is gone."""
    files = sorted(f for f in entry.rglob("*") if f.is_file()) if entry.is_dir() else [entry]
    states: dict[Path, FileState | None] = {}
    for f in files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            states[f] = None
            continue
        states[f] = FileState(st.st_size, st.st_mtime_ns, st.st_ino)
    return states


class InputWatch:
    """The input files of one run of a job. `output_dir` is named in the message."""

    def __init__(self, files: Sequence[str], digests: Mapping[str, Any], output_dir: Path) -> None:
        self.entries = [Path(f) for f in files]
        self.digests = dict(digests)
        self.output_dir = output_dir
        self.states = {e: file_states(e) for e in self.entries}

    def check(self) -> None:
        """Raise JobStoppedError naming the first input whose size, mtime or inode changed, or
        that appeared or went away since the job started, unless its digest is the job's."""
        for entry, before in self.states.items():
            now = file_states(entry)
            if now == before:
                continue
            for f in sorted(set(before) | set(now)):
                old, new = before.get(f), now.get(f)
                if old != new and not self._same_bytes(entry):
                    raise self._changed(f, _what_changed(old, new))
            self.states[entry] = now  # the same bytes: watch the file as it is now

    def _same_bytes(self, entry: Path) -> bool:
        expected = self.digests.get(str(entry))
        try:
            return expected is not None and file_digest(entry) == expected
        except OSError:  # gone, or unreadable now
            return False

    def check_digests(self) -> None:
        """Take every input's digest again; raise JobStoppedError if one differs from the job's
        (the one its results are filed under)."""
        for entry in self.entries:
            expected = self.digests.get(str(entry))
            if expected is not None and not self._same_bytes(entry):
                raise JobStoppedError(
                    f"input file {entry} changed while the job ran (its contents differ from "
                    "when the job started, though its size and mtime are the same), so the rows "
                    f"saved in {self.output_dir} may mix the old file and the new: rerun with "
                    "overwrite=true to start over"
                )

    def _changed(self, path: Path, what: str) -> JobStoppedError:
        return JobStoppedError(
            f"input file {path} changed while the job ran ({what}); the job stopped, and the "
            f"rows saved in {self.output_dir} were made from the file as it was. Restore it and "
            "rerun to resume, or rerun with overwrite=true to start over on the new file"
        )


def _what_changed(old: FileState | None, new: FileState | None) -> str:
    if old is None:
        return "it appeared"
    if new is None:
        return "it was removed"
    if old.size != new.size:
        return f"size {old.size:,} -> {new.size:,} bytes"
    if old.inode != new.inode:
        return "it was replaced by another file"
    return "it was modified"
