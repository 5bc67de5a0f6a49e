"""progress.json: where a running job stands, for whoever watches a job that runs for a day.

Rewritten whole through the output folder's store (a reader never sees half a file) at most
every `every_s` seconds while rows finish and engine steps run, at every window's end and when
the job stops: rows done and failed out of the total, the output rate and the time left at
that rate (the progress bar's own figures), with executor=ray each replica's rows and rate and
the replicas lost and replaced, and with dataset.lora_column the rows done per adapter.
run.json names the file; it stays after the job as its last state. A write goes to the store
on a thread of its own (an object PUT need not pause the job); the error of one that failed is
raised by the next write, and the last write (`wait=True`) is waited for.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from batchpage.job.progress import JobProgress
from batchpage.output.files import PROGRESS_FILE, output_folder, store_of
from batchpage.storage import Store


class ProgressFile:
    def __init__(
        self,
        out: str | os.PathLike,
        progress: JobProgress,
        executor: Callable[[], dict[str, Any]] | None = None,
        every_s: float = 10.0,
        store: Store | None = None,
    ) -> None:
        """`executor`: the executor's figures now (ReplicaPool.describe's), None for local.
        `store`: the output folder's (default: the store of `out`)."""
        folder = output_folder(out)
        self.store = store_of(folder, store)
        self.path = self.store.join(folder, PROGRESS_FILE)
        self.progress = progress
        self.executor = executor
        self.every_s = every_s
        self._last = float("-inf")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchpage-progress")
        self._pending: Future[None] | None = None
        # Rows done in this run per adapter name ("base": none); the job counts them.
        self.rows_by_adapter: Counter[str] = Counter()

    def maybe_write(self) -> None:
        """Rewrite the file if the last write is at least every_s old."""
        if time.monotonic() - self._last >= self.every_s:
            self.write()

    def write(self, stage: str | None = None, wait: bool = False) -> None:
        """Rewrite the file now (on the writing thread; `wait`: and wait for it); `stage`
        overrides the bar's ("done" at the end). Raises the error of the write before, if it
        failed."""
        record: dict[str, Any] = {
            "updated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.progress.snapshot(),
        }
        if stage is not None:
            record["stage"] = stage
        if self.executor is not None:
            record["executor"] = self.executor()
        if self.rows_by_adapter:
            record["rows_by_adapter"] = dict(sorted(self.rows_by_adapter.items()))
        data = (json.dumps(record, indent=1) + "\n").encode()
        self.settle()
        self._pending = self._writer.submit(self.store.write_bytes, self.path, data)
        self._last = time.monotonic()
        if wait:
            self.settle()

    def settle(self) -> None:
        """Wait for the write in flight; raise its error if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Stop the writing thread once its write is done (its error, if any, is dropped: the
        job is ending on another one)."""
        self._writer.shutdown(wait=True)
