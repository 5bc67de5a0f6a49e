"""Files of an output_dir: names, the typed schema, atomic writes, shard listing, the dir lock.

Layout of an output_dir (its top level holds only what users read; the job's working files
are in a hidden subfolder, which Parquet dataset readers skip):
    .batchpage/job.json        what the results depend on (model, sampling, dataset) + its hash
    .batchpage/shard-00000.parquet ...   finished rows, in finishing order; each file is
                               complete or absent
    .batchpage/job.lock        held by the writer while the job runs
    completions.parquet        one row per input row, sorted by index
    run.json                   resolved config, versions, metrics
    batch_output.jsonl, batch_errors.jsonl   for an OpenAI Batch input (batch_files.py)
    scores.parquet             with score=humaneval: one verdict per sample
    .<name>.*.tmp, .finalize.*.tmp   a file (or the merge's buckets) being written: a leftover
                               one is a crash, deleted by the next writer of the folder
Folders written before the subfolder existed (job.json and shards at the top) are moved into it
by the next writer (`adopt_old_layout`), so they resume.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.fileio import atomic_path

WORK_DIR = ".batchpage"
JOB_FILE = "job.json"
FINAL_FILE = "completions.parquet"
RUN_FILE = "run.json"
BATCH_OUTPUT_FILE = "batch_output.jsonl"
BATCH_ERRORS_FILE = "batch_errors.jsonl"
SCORES_FILE = "scores.parquet"
SHARD_PREFIX = "shard-"
LOCK_FILE = "job.lock"
PROGRESS_FILE = "progress.json"  # where a running job stands (job/progress_file.py)
# What a job writes beside its shards, all rewritten from them: overwrite=true deletes them.
DERIVED_FILES = (FINAL_FILE, BATCH_OUTPUT_FILE, BATCH_ERRORS_FILE, SCORES_FILE)
# Temporary names of what is written in an output_dir (fileio.atomic_path: ".<name>.*.tmp";
# finalize's bucket folder), so a leftover of a kill -9 is recognised as ours.
_TEMP_GLOBS = (
    f".{SHARD_PREFIX}*.tmp",
    *(f".{name}.*.tmp" for name in (*DERIVED_FILES, JOB_FILE, RUN_FILE, PROGRESS_FILE)),
    ".finalize.*.tmp",
)


def output_schema(
    n: int = 1, extra: pa.Schema | None = None, *, listed: bool | None = None
) -> pa.Schema:
    """The typed schema of shards and completions.parquet. `listed` (default: n > 1) makes
    completion and finish_reason lists, one item per sample: a job whose rows choose their own
    n has lists in every row. `extra` columns (derived ones such as extracted code, then
    carried input columns) follow batchpage's own."""
    text = pa.list_(pa.string()) if (n > 1 if listed is None else listed) else pa.string()
    own = pa.schema(
        [
            ("id", pa.string()),
            ("index", pa.int64()),
            ("prompt", pa.string()),
            ("completion", text),
            ("finish_reason", text),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),  # summed over the n samples
            ("cached_tokens", pa.int64()),
            ("error", pa.string()),
        ]
    )
    if extra is None:
        return own
    clash = sorted(set(own.names) & set(extra.names))
    if clash:
        raise ValueError(f"extra output columns {clash} clash with batchpage's own columns")
    if len(set(extra.names)) != len(extra.names):
        raise ValueError(f"extra output columns {extra.names} hold a name twice")
    return pa.schema([*own, *extra])


def schema_to_text(schema: pa.Schema) -> str:
    """An Arrow schema as text for job.json (nested and timestamp types survive)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


@dataclass
class ResultRow:
    """One output row. An error row has `error` set and no completion."""

    index: int
    id: str | None  # None: a line without a readable id (see data.rows.Row.id)
    prompt: str | None = None
    completion: str | list[str] | None = None
    finish_reason: str | list[str] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # values of the writer's extra columns

    def record(self) -> dict[str, Any]:
        """Column name -> value, batchpage's columns then the extra ones."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**own, **self.extra}

    @classmethod
    def failed(
        cls,
        index: int,
        id: str | None,
        error: str,
        prompt: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ResultRow:
        return cls(index=index, id=id, prompt=prompt, error=error, extra=dict(extra or {}))


class OutputDirError(ValueError):
    """output_dir belongs to another job, or is in use; the message says what to do."""


class IncompleteOutputError(RuntimeError):
    """finalize found input rows without an output row; rerunning the job resumes them."""


def job_fingerprint(job: Mapping[str, Any]) -> str:
    """A stable hash of the result-affecting config (key order does not matter)."""
    return hashlib.sha256(json.dumps(job, sort_keys=True, default=str).encode()).hexdigest()[:16]


def scan_shards(output_dir: Path) -> tuple[set[int], int]:
    """Indices held by the shards in output_dir, and the highest shard number (-1 if none).

    A shard that cannot be read is renamed aside (never deleted: it is evidence) and its rows are
    generated again; with atomic writes this only happens if something else damaged the file.
    """
    done: set[int] = set()
    last = -1
    for number, path in list_shards(output_dir):
        last = max(last, number)
        try:
            done.update(pq.read_table(path, columns=["index"]).column(0).to_pylist())
        except (pa.ArrowException, OSError) as e:
            warnings.warn(f"unreadable shard {path} set aside ({e})", stacklevel=2)
            path.rename(path.with_name(f".corrupt-{path.name}"))
    return done, last


def work_dir(output_dir: str | os.PathLike) -> Path:
    """The subfolder of output_dir that holds the job's working files (job.json, shards, lock)."""
    return Path(output_dir) / WORK_DIR


def adopt_old_layout(output_dir: Path) -> list[Path]:
    """Move the job.json and shards of a folder written before the working subfolder existed
    into it (call it holding the lock); returns their new paths."""
    moved = []
    for p in [output_dir / JOB_FILE, *output_dir.glob(f"{SHARD_PREFIX}*.parquet")]:
        if p.is_file():
            target = work_dir(output_dir) / p.name
            os.replace(p, target)
            moved.append(target)
    return moved


def list_shards(output_dir: Path) -> list[tuple[int, Path]]:
    """(number, path) of each shard, by number: that is the order they were written in."""
    shards = []
    for p in work_dir(output_dir).glob(f"{SHARD_PREFIX}*.parquet"):
        number = p.name[len(SHARD_PREFIX) : -len(".parquet")]
        if number.isdigit():
            shards.append((int(number), p))
    return sorted(shards)


def read_job(output_dir: str | os.PathLike) -> dict[str, Any]:
    """job.json as a dict. Raises OutputDirError when it is missing or damaged (not JSON, not
    an object), naming the file and the fix."""
    path = work_dir(output_dir) / JOB_FILE
    if not path.exists():
        raise OutputDirError(f"{path} is missing: this output_dir was not made by a ShardWriter")
    try:
        job = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise damaged_job_file(path, str(e)) from None
    if not isinstance(job, dict):
        raise damaged_job_file(path, f"it holds a JSON {type(job).__name__}, not an object")
    return job


def damaged_job_file(path: Path, why: str) -> OutputDirError:
    return OutputDirError(
        f"{path} is damaged ({why[:200]}), so its results cannot be matched to this job: pass "
        f"overwrite=true to delete the results in {path.parent} and start over, or use another "
        "output_dir"
    )


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Delete the temporary files (and finalize's bucket folders) that a killed writer left in
    output_dir; returns what was deleted. Call it only while holding the folder's lock: a live
    writer's temporary files match too."""
    removed = []
    for pattern in _TEMP_GLOBS:
        for p in [*output_dir.glob(pattern), *work_dir(output_dir).glob(pattern)]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def atomic_write_table(table: pa.Table, path: Path) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def lock_dir(folder: Path) -> int | None:
    """Hold an exclusive flock on the folder (its working subfolder's lock file, which must
    exist) for the writer's life: two jobs writing into one
    output_dir would each resume from the same shards and duplicate rows. The OS drops the lock
    when the process dies, so a kill -9 never leaves a stale lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: run without the guard
        return None
    fd = os.open(work_dir(folder) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        raise OutputDirError(
            f"output_dir {folder} is in use by another batchpage job; wait for it or use "
            "another output_dir"
        ) from e
    return fd
