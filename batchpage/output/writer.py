"""Writing results: typed Parquet shards written whole as rows finish, resume, job identity.

The files and their layout are described in `batchpage.output.files`; they go through the
output folder's Store, so a local folder and a bucket take the same path.

Why this survives kill -9 at any moment: a shard is created whole or not at all
(Store.create_bytes: a linked temp file locally, a conditional PUT on object storage), so every
shard-*.parquet is whole; rows still in the buffer are simply generated again on resume. Resume
is keyed on the row index, and a row is never added twice, because the writer skips indices
that any shard already holds. One writer owns a folder (Store.lock: an flock, or a lease with
heartbeats); it checks that it still does before each shard, and a shard key someone else
created first is never overwritten.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from batchpage.output.files import (
    DERIVED_FILES,
    JOB_FILE,
    PROGRESS_FILE,
    RUN_FILE,
    TEMP_GLOBS,
    OutputDirError,
    ResultRow,
    adopt_old_layout,
    in_use,
    job_fingerprint,
    list_shards,
    load_job,
    output_folder,
    output_schema,
    scan_shards,
    schema_to_text,
    shard_name,
    store_of,
    table_bytes,
    work_folder,
)
from batchpage.output.shard_upload import PendingShard, ShardUploads
from batchpage.storage import JobLock, LockHeldError, OutputLostError, StorageConfig, Store


class ShardWriter:
    """Buffers finished rows and flushes them as atomic shards every `flush_rows` rows or
    `flush_seconds` seconds. Use as a context manager (close flushes).

    config_fingerprint: the result-affecting config as a dict (stored in job.json, so that a
    mismatch can say which fields changed) or an already computed hash string.
    overwrite: on a fingerprint mismatch, delete the old results instead of refusing.
    extra_schema: columns after batchpage's own (derived or carried ones); part of the job.
    listed: completion and finish_reason as lists in every row (default: n > 1); a job whose
    rows set their own n needs them.
    store: the output folder's store (default: Stores().store_for(output_dir)).
    lease_seconds: how long the writer's lease on an object-storage folder lasts without a
    heartbeat (storage.lease_seconds); a local folder's flock needs none.

    Raises OutputDirError when another live job holds the folder, or it holds another job's
    results. While writing, OutputLostError when another job took the folder over (a lease
    that expired) or created a shard this writer was about to: nothing of theirs is replaced.
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
        store: Store | None = None,
        lease_seconds: float = StorageConfig.lease_seconds,
    ) -> None:
        if n < 1 or flush_rows < 1:
            raise ValueError(f"need n >= 1 and flush_rows >= 1, got n={n}, flush_rows={flush_rows}")
        self.output_dir = output_folder(output_dir)
        self.store = store_of(self.output_dir, store)
        self.n = n
        self.listed = n > 1 if listed is None else listed
        self.extra_schema = extra_schema
        self.schema = output_schema(n, extra_schema, listed=self.listed)
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._buffer: list[dict[str, Any]] = []
        self._uploads = ShardUploads(self._write_shard)
        self._last_flush = time.monotonic()
        self.work = work_folder(self.store, self.output_dir)
        try:
            self._lock: JobLock | None = self.store.lock(self.work, lease_seconds)
        except LockHeldError as e:
            raise in_use(self.output_dir, e) from None
        try:
            # A flush, merge or rewrite that a crash cut short: its rows were never "done",
            # and every file it was writing is rewritten from the shards.
            self.store.remove_leftovers(self.output_dir, TEMP_GLOBS)
            adopt_old_layout(self.store, self.output_dir)
            self._claim(config_fingerprint, overwrite)
            self._done, last = scan_shards(self.store, self.output_dir)
            self._next_shard = last + 1
        except BaseException:
            self._release()
            raise

    # --- public -------------------------------------------------------------------------------

    def done_indices(self) -> frozenset[int]:
        """Indices written (on disk or buffered). A copy (a set: an int object and a hash slot
        a row, where the writer keeps a bit): call it once, then use is_done."""
        return frozenset(self._done)

    def is_done(self, index: int) -> bool:
        return index in self._done

    @property
    def num_done(self) -> int:
        return len(self._done)

    @property
    def num_saved(self) -> int:
        """Rows saved: done less those still buffered or not yet written (a shard in flight, or
        one whose write failed)."""
        return len(self._done) - len(self._buffer) - self._uploads.unsaved_rows

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
            self._flush(wait=False)
            return True
        return False

    def flush(self) -> None:
        """Write the buffered rows as the next shard and wait until every shard is saved.
        OutputLostError (the rows stay unsaved) when another job owns the folder now or
        created that shard first; a store's error when the write failed."""
        self._flush(wait=True)

    def settle(self) -> None:
        """Wait until the shards already handed over are saved (the buffer stays); raise the
        error of one that was not."""
        self._uploads.settle()

    def _flush(self, wait: bool) -> None:
        """The buffered rows to the upload thread (shard_upload.py). A write that failed before
        is retried first, and its error raised again if it fails again."""
        self._uploads.settle()
        if self._buffer:
            data = table_bytes(pa.Table.from_pylist(self._buffer, schema=self.schema))
            self._uploads.submit(PendingShard(self._next_shard, self._buffer, data))
            self._next_shard += 1
            self._buffer = []
            self._last_flush = time.monotonic()
        if wait:
            self._uploads.settle()

    def _write_shard(self, shard: PendingShard) -> None:
        """On the upload thread: create the shard's key, never replacing one."""
        path = self.store.join(self.work, shard_name(shard.number))
        self.check()  # right before the write: the less time between, the better
        if not self.store.create_bytes(path, shard.data):
            raise OutputLostError(
                f"{path} was created by another writer of output_dir {self.output_dir}: this job "
                "stops without replacing it. Run one batchpage job per output_dir, then rerun "
                "into it to resume"
            )

    def check(self) -> None:
        """OutputLostError when this writer no longer owns the output folder (its lease expired
        and another job took it over); call it before anything that commits results."""
        if self._lock is not None:
            self._lock.check()

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
        self.fingerprint = fp  # job.json's: what the commit (_SUCCESS) names the job by
        store, out = self.store, self.output_dir
        try:
            old = load_job(store, out)
        except OutputDirError:
            if not overwrite:
                raise
            old = {}
        if old is not None and old.get("fingerprint") == fp:
            return  # same job: resume
        # _SUCCESS first (DERIVED_FILES' order): it must never outlive what it describes.
        ours = [store.join(out, name) for name in DERIVED_FILES]
        ours += [path for _, path in list_shards(store, out)]
        if old is not None:
            problem = "was written by a different job"
            changes = _diff(old.get("job"), job) if job and old.get("job") else ""
            if changes:
                problem += f" (changed: {changes})"
        elif any(store.exists(p) for p in ours):
            problem = f"holds results without a {JOB_FILE}, so they cannot be matched to this job"
        else:
            problem = None
        if problem is not None and not overwrite:
            raise OutputDirError(
                f"output_dir {out} {problem}. Use another output_dir, or pass "
                "overwrite=true to delete its results and start over."
            )
        if problem is not None:
            for path in [*ours, store.join(out, RUN_FILE), store.join(out, PROGRESS_FILE)]:
                store.delete(path)
        payload = {
            "fingerprint": fp,
            "n": self.n,
            "listed": self.listed,
            "job": job,
            "created": time.time(),
        }
        if extra is not None:
            payload["extra_schema"] = extra
        text = json.dumps(payload, indent=2, sort_keys=True, default=str)
        store.write_bytes(store.join(self.work, JOB_FILE), text.encode())

    def _release(self) -> None:
        # No write may outlive the lock: the shard in flight lands (or fails) first.
        self._uploads.close()
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()


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
