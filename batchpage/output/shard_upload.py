"""Shards written on a thread of their own, so that a slow store (an object PUT over the network)
overlaps generation instead of pausing it.

At most one shard is in flight: the next write first settles the one before, so memory holds at
most two shards' bytes and shards land in the order they were made. A write that fails keeps its
shard (same number, same bytes) as `failed`: its error is raised to the caller at the next flush,
and the shard is retried before any newer one, so a retry never writes its rows under a second
key.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple


class PendingShard(NamedTuple):
    number: int
    rows: list[dict[str, Any]]
    data: bytes  # the Parquet file


class ShardUploads:
    """`write(shard)` runs on the upload thread (it must raise when the shard is not saved)."""

    def __init__(self, write: Callable[[PendingShard], None]) -> None:
        self._write = write
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchpage-shards")
        self._inflight: tuple[PendingShard, Future[None]] | None = None
        self.failed: PendingShard | None = None

    @property
    def unsaved_rows(self) -> int:
        """Rows handed over and not known to be saved (in flight, or failed)."""
        shards = [self.failed, self._inflight[0] if self._inflight else None]
        return sum(len(s.rows) for s in shards if s is not None)

    def settle(self) -> None:
        """Wait for the shard in flight, then retry a failed one; raise the error of a write that
        failed (its shard is then `failed`, kept for the next try)."""
        if self._inflight is not None:
            shard, done = self._inflight
            self._inflight = None
            try:
                done.result()
            except BaseException:
                self.failed = shard
                raise
        if self.failed is not None:
            shard, self.failed = self.failed, None
            try:
                self._write(shard)
            except BaseException:
                self.failed = shard
                raise

    def submit(self, shard: PendingShard) -> None:
        """Start writing `shard`; call `settle` first (one shard in flight at a time)."""
        assert self._inflight is None and self.failed is None, "settle before submit"
        self._inflight = (shard, self._pool.submit(self._write, shard))

    def close(self) -> None:
        """Wait for the write in flight (its outcome is left to `settle`) and stop the thread."""
        self._pool.shutdown(wait=True)
