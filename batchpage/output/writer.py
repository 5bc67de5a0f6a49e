"""Writing results: typed Parquet shards written atomically as rows finish, resume, job identity.

The files and their layout are described in `batchpage.output.files`.

Why this survives kill -9 at any moment: a shard becomes visible only through os.replace of a
fsynced temp file, so every shard-*.parquet on disk is whole; rows still in the buffer are simply
generated again on resume. Resume is keyed on the row index, and a row is never added twice,
because the writer skips indices that any shard already holds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchpage.fileio import atomic_write_text
from batchpage.output.files import (
    DERIVED_FILES,
    JOB_FILE,
    PROGRESS_FILE,
    RUN_FILE,
    SHARD_PREFIX,
    OutputDirError,
    ResultRow,
    adopt_old_layout,
    atomic_write_table,
    job_fingerprint,
    lock_dir,
    output_schema,
    read_job,
    remove_leftovers,
    scan_shards,
    schema_to_text,
    work_dir,
)


class ShardWriter:
    """Buffers finished rows and flushes them as atomic shards every `flush_rows` rows or
    `flush_seconds` seconds. Use as a context manager (close flushes).

    config_fingerprint: the result-affecting config as a dict (stored in job.json, so that a
    mismatch can say which fields changed) or an already computed hash string.
    overwrite: on a fingerprint mismatch, delete the old results instead of refusing.
    extra_schema: columns after batchpage's own (derived or carried ones); part of the job.
    listed: completion and finish_reason as lists in every row (default: n > 1); a job whose
    rows set their own n needs them.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        config_fingerprint: Mapping[str, Any] | str,
        n: int = 1,
        *,
        overwrite: bool = False,
        flush_rows: int = 256,
        flush_seconds: float = 30.0,
        extra_schema: pa.Schema | None = None,
        listed: bool | None = None,
    ) -> None:
        if n < 1 or flush_rows < 1:
            raise ValueError(f"need n >= 1 and flush_rows >= 1, got n={n}, flush_rows={flush_rows}")
        self.output_dir = Path(output_dir)
        self.n = n
        self.listed = n > 1 if listed is None else listed
        self.extra_schema = extra_schema
        self.schema = output_schema(n, extra_schema, listed=self.listed)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._buffer: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self.work = work_dir(self.output_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self._lock = lock_dir(self.output_dir)
        try:
            # A flush, merge or rewrite that a crash cut short: its rows were never "done",
            # and every file it was writing is rewritten from the shards.
            remove_leftovers(self.output_dir)
            adopt_old_layout(self.output_dir)
            self._claim(config_fingerprint, overwrite)
            self._done, last = scan_shards(self.output_dir)
            self._next_shard = last + 1
        except BaseException:
            self._release()
            raise

    # --- public -------------------------------------------------------------------------------

    def done_indices(self) -> frozenset[int]:
        """Indices written (on disk or buffered). A copy: call it once, then use is_done."""
        return frozenset(self._done)

    def is_done(self, index: int) -> bool:
        return index in self._done

    @property
    def num_done(self) -> int:
        return len(self._done)

    @property
    def num_saved(self) -> int:
        """Rows on disk: done less those still buffered (e.g. after a flush that failed)."""
        return len(self._done) - len(self._buffer)

    def add(self, row: ResultRow | Mapping[str, Any]) -> bool:
        """Buffer one finished row; flush when due. Returns False (and drops it) for an index
        that is already done, so a row can never be written twice."""
        rec = row.record() if isinstance(row, ResultRow) else dict(row)
        index = rec.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"a result row needs an int index >= 0, got {index!r}")
        if index in self._done:
            return False
        want = list if self.listed else str
        for key in ("completion", "finish_reason"):
            if rec.get(key) is not None and not isinstance(rec[key], want):
                raise TypeError(f"{key} must be {want.__name__} or None with n={self.n}")
        self._buffer.append({name: rec.get(name) for name in self.schema.names})
        self._done.add(index)
        self.maybe_flush()
        return True

    def add_many(self, rows: Iterable[ResultRow | Mapping[str, Any]]) -> int:
        return sum(self.add(r) for r in rows)

    def maybe_flush(self) -> bool:
        """Flush if the buffer is full or old; call it now and then while rows are slow."""
        due = len(self._buffer) >= self.flush_rows or (
            time.monotonic() - self._last_flush >= self.flush_seconds
        )
        if due and self._buffer:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        if not self._buffer:
            return
        table = pa.Table.from_pylist(self._buffer, schema=self.schema)
        name = f"{SHARD_PREFIX}{self._next_shard:05d}.parquet"
        atomic_write_table(table, self.work / name)
        self._next_shard += 1
        self._buffer = []
        self._last_flush = time.monotonic()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # Flush even on an exception: the buffered rows are finished results. When that
        # exception is itself a failed write (a full disk), a second failure of the same flush
        # says nothing new: the first goes on, and the rows left buffered are generated again
        # on resume.
        try:
            self.flush()
        except OSError:
            if not isinstance(exc, OSError):
                raise
        finally:
            self._release()

    # --- internals ----------------------------------------------------------------------------

    def _claim(self, config: Mapping[str, Any] | str, overwrite: bool) -> None:
        extra = schema_to_text(self.extra_schema) if self.extra_schema is not None else None
        job = None if isinstance(config, str) else {**config, "n": self.n}
        if job is not None and extra is not None:
            job["extra"] = extra
        if job is not None and self.listed != (self.n > 1):  # only then: old jobs keep their id
            job["listed"] = self.listed
        fp = config if isinstance(config, str) else job_fingerprint(job)
        job_path = self.work / JOB_FILE
        ours = [
            *self.work.glob(f"{SHARD_PREFIX}*.parquet"),
            *(self.output_dir / name for name in DERIVED_FILES),
        ]
        if job_path.exists():
            try:
                old = read_job(self.output_dir)
            except OutputDirError:
                if not overwrite:
                    raise
                old = {}
            if old.get("fingerprint") == fp:
                return  # same job: resume
            problem = "was written by a different job"
            changes = _diff(old.get("job"), job) if job and old.get("job") else ""
            if changes:
                problem += f" (changed: {changes})"
        elif any(p.exists() for p in ours):
            problem = f"holds results without a {JOB_FILE}, so they cannot be matched to this job"
        else:
            problem = None
        if problem is not None and not overwrite:
            raise OutputDirError(
                f"output_dir {self.output_dir} {problem}. Use another output_dir, or pass "
                "overwrite=true to delete its results and start over."
            )
        if problem is not None:
            for p in [*ours, self.output_dir / RUN_FILE, self.output_dir / PROGRESS_FILE]:
                p.unlink(missing_ok=True)
        payload = {
            "fingerprint": fp,
            "n": self.n,
            "listed": self.listed,
            "job": job,
            "created": time.time(),
        }
        if extra is not None:
            payload["extra_schema"] = extra
        atomic_write_text(job_path, json.dumps(payload, indent=2, sort_keys=True, default=str))

    def _release(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the fd drops the flock
            self._lock = None


def _diff(old: Any, new: Any, path: str = "") -> str:
    """'sampling.temperature: 0.0 -> 0.7, ...' for the leaves that differ (the first five)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return "" if old == new else f"{path or 'config'}: {_short(old)} -> {_short(new)}"
    keys = sorted(set(old) | set(new), key=str)
    parts = [d for k in keys if (d := _diff(old.get(k), new.get(k), f"{path}.{k}" if path else k))]
    more = f", and {len(parts) - 5} more" if len(parts) > 5 else ""
    return ", ".join(parts[:5]) + more


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
