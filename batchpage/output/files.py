"""Files of an output_dir: names, the typed schema, shard listing, job.json.

An output_dir is a local folder or a URL ("s3://bucket/run-42"); every file goes through its
`Store` (batchpage.storage), with paths as strings joined by `store.join`, so local folders and
object storage take the same code. Layout (the top level holds only what users read; the job's
working files are in a hidden subfolder, which Parquet dataset readers skip):
    .batchpage/job.json        what the results depend on (model, sampling, dataset) + its hash
    .batchpage/shard-00000.parquet ...   finished rows, in finishing order; each is created
                               whole and never replaced (Store.create_bytes)
    .batchpage/job.lock        the writer's lock (local: an flock; object storage: a lease)
    completions.parquet        one row per input row, sorted by index
    batch_output.jsonl, batch_errors.jsonl   for an OpenAI Batch input (batch_files.py)
    scores.parquet             with score=humaneval: one verdict per sample
    _SUCCESS                   the commit point (manifest.py): written last of the files above,
                               it lists them with their sizes and sha256
    run.json                   resolved config, versions, metrics (written at the very end)
    .<name>.*.tmp, .finalize.*.tmp   a file (or the merge's buckets) being written: a leftover
                               one is a crash, deleted by the next writer of the folder (with
                               object storage: unfinished multipart uploads, aborted)
Folders written before the subfolder existed (job.json and shards at the top) are moved into it
by the next writer (`adopt_old_layout`), so they resume.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.output.row_set import RowSet
from batchpage.storage import Store, Stores, is_url, local_path

WORK_DIR = ".batchpage"
JOB_FILE = "job.json"
FINAL_FILE = "completions.parquet"
RUN_FILE = "run.json"
BATCH_OUTPUT_FILE = "batch_output.jsonl"
BATCH_ERRORS_FILE = "batch_errors.jsonl"
SCORES_FILE = "scores.parquet"
SHARD_PREFIX = "shard-"
PROGRESS_FILE = "progress.json"  # where a running job stands (job/progress_file.py)
SUCCESS_FILE = "_SUCCESS"  # the commit point: a manifest of the files below (manifest.py)
# What a job writes beside its shards, all rewritten from them: overwrite=true deletes them,
# _SUCCESS first, so that it never describes files that are no longer there.
DERIVED_FILES = (SUCCESS_FILE, FINAL_FILE, BATCH_OUTPUT_FILE, BATCH_ERRORS_FILE, SCORES_FILE)
# Temporary names of what is written in an output_dir (fileio.atomic_path: ".<name>.*.tmp";
# finalize's bucket folder), so a leftover of a kill -9 is recognised as ours.
TEMP_GLOBS = (
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


def output_folder(output_dir: str | os.PathLike) -> str:
    """output_dir as the string its store takes: a URL without a trailing "/", a local path
    without a file:// prefix."""
    text = os.fspath(output_dir)
    return text.rstrip("/") if is_url(text) else local_path(text)


def store_of(output_dir: str | os.PathLike, store: Store | None = None) -> Store:
    """`store`, or the store of output_dir with the default storage options (for callers
    outside a job; a job passes its own, made from its `storage.*` settings)."""
    return store if store is not None else Stores().store_for(output_folder(output_dir))


def work_folder(store: Store, output_dir: str) -> str:
    """The subfolder of output_dir that holds the job's working files (job.json, shards, lock)."""
    return store.join(output_dir, WORK_DIR)


def work_dir(output_dir: str | os.PathLike) -> Path:
    """work_folder of a local output_dir, as a Path (for tests and scripts that look inside)."""
    return Path(output_dir) / WORK_DIR


def shard_name(number: int) -> str:
    """Shard keys are deterministic: the n-th flush of a folder always writes the same name."""
    return f"{SHARD_PREFIX}{number:05d}.parquet"


def list_shards(store: Store, output_dir: str) -> list[tuple[int, str]]:
    """(number, path) of each shard, by number: that is the order they were written in."""
    shards = []
    for found in store.files_under(work_folder(store, output_dir)):
        name = store.name(found.path)
        number = name[len(SHARD_PREFIX) : -len(".parquet")]
        if name.startswith(SHARD_PREFIX) and name.endswith(".parquet") and number.isdigit():
            shards.append((int(number), found.path))
    return sorted(shards)


def read_each(store: Store, paths: Sequence[str], ahead: int = 8) -> Iterator[bytes]:
    """The bytes of each file, in order, fetched `ahead` at a time in threads: shards are small,
    and one request per shard over a network is slow one after the other. At most `ahead`
    files are held at once."""
    if not paths:
        return
    with ThreadPoolExecutor(min(ahead, len(paths))) as pool:
        pending: list[Future[bytes]] = []
        for path in paths:
            pending.append(pool.submit(store.read_bytes, path))
            if len(pending) >= ahead:
                yield pending.pop(0).result()
        for done in pending:
            yield done.result()


def scan_shards(store: Store, output_dir: str) -> tuple[RowSet, int]:
    """Indices held by the shards in output_dir, and the highest shard number (-1 if none).

    A shard that cannot be parsed is renamed aside (never deleted: it is evidence) and its rows
    are generated again; shards are created whole, so only something else damages one. A shard
    that cannot be fetched (a store that fails) raises: that says nothing about the shard.
    """
    done = RowSet()
    shards = list_shards(store, output_dir)
    for (_, path), data in zip(shards, read_each(store, [p for _, p in shards]), strict=True):
        try:
            table = pq.read_table(pa.BufferReader(data), columns=["index"])
        except pa.ArrowException as e:
            warnings.warn(f"unreadable shard {path} set aside ({e})", stacklevel=2)
            store.move_aside(path, f".corrupt-{store.name(path)}")
            continue
        done.update(table.column(0).to_numpy())
    return done, max((number for number, _ in shards), default=-1)


def adopt_old_layout(store: Store, output_dir: str) -> list[str]:
    """Move the job.json and shards of a folder written before the working subfolder existed
    into it (call it holding the lock); returns their new paths. Each is created in its new
    place before the old one goes, so a kill in between loses nothing."""
    moved = []
    old = [store.join(output_dir, JOB_FILE), *store.glob(store.join(output_dir, "shard-*"))]
    for path in old:
        name = store.name(path)
        if not (name == JOB_FILE or name.endswith(".parquet")) or not store.exists(path):
            continue
        target = store.join(work_folder(store, output_dir), name)
        store.create_bytes(target, store.read_bytes(path))  # False: a kill came after it
        store.delete(path)
        moved.append(target)
    return moved


def load_job(store: Store, output_dir: str) -> dict[str, Any] | None:
    """job.json as a dict, None when there is none. Raises OutputDirError when it is damaged
    (not JSON, not an object), naming the file and the fix."""
    path = store.join(work_folder(store, output_dir), JOB_FILE)
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        job = json.loads(data)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise damaged_job_file(path, str(e), output_dir) from None
    if not isinstance(job, dict):
        raise damaged_job_file(
            path, f"it holds a JSON {type(job).__name__}, not an object", output_dir
        )
    return job


def read_job(output_dir: str | os.PathLike, store: Store | None = None) -> dict[str, Any]:
    """job.json as a dict. Raises OutputDirError when it is missing or damaged, naming the file
    and the fix."""
    out = output_folder(output_dir)
    store = store_of(out, store)
    job = load_job(store, out)
    if job is None:
        path = store.join(work_folder(store, out), JOB_FILE)
        raise OutputDirError(f"{path} is missing: this output_dir was not made by a ShardWriter")
    return job


def damaged_job_file(path: str, why: str, output_dir: str) -> OutputDirError:
    return OutputDirError(
        f"{path} is damaged ({why[:200]}), so its results cannot be matched to this job: pass "
        f"overwrite=true to delete the results in {output_dir} and start over, or use another "
        "output_dir"
    )


def table_bytes(table: pa.Table) -> bytes:
    """A table as the bytes of a Parquet file (a shard is small: it is built in memory, then
    written in one request)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def in_use(output_dir: str, held: Exception) -> OutputDirError:
    """The one line for a folder another live job holds; `held` (the store's LockHeldError)
    says by whom, and for a lease when it expires if that job died."""
    return OutputDirError(
        f"output_dir {output_dir} is in use by another batchpage job "
        f"({' '.join(str(held).split())}): wait for it, or use another output_dir"
    )
