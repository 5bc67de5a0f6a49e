"""The figures of a run on several replicas: one generate call's, live, and each replica's.

A generate call's RunStats counts the work of every replica (finished windows, plus the latest
figures of the running ones), over the call's wall time, so its throughput is the cluster's.
Each replica's own figures are over the time it spent generating, so its throughput and prefix
hit rate are its own; run.json records both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from batchpage.metrics import RunStats

# The per-replica figures that run.json keeps (RunStats.as_dict names).
REPLICA_FIELDS = (
    "elapsed_s",
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "output_tokens_per_s",
    "prefill_tokens_computed",
    "cached_prompt_tokens",
    "prefix_hit_rate",
    "preemptions",
    "peak_running",
    "kv_utilization",
)


def stats_of(record: dict[str, float | int], block_size: int) -> RunStats | None:
    return RunStats.from_record(record, block_size) if record else None


class CallStats:
    """One generate call across replicas: what on_step reports and what run_stats becomes."""

    def __init__(self, kv_blocks_total: int, block_size: int) -> None:
        self.start = time.perf_counter()
        self.block_size = block_size
        self._base = RunStats(kv_blocks_total, block_size, start=0.0, end=0.0)
        self._closed: list[RunStats] = []
        self._running: dict[int, RunStats] = {}

    def update(self, window_id: int, record: dict[str, float | int]) -> None:
        stats = stats_of(record, self.block_size)
        if stats is not None:
            self._running[window_id] = stats

    def close(self, window_id: int, stats: RunStats | None = None) -> None:
        """The window ended: with its final figures, or (a dead replica) with its last ones."""
        last = self._running.pop(window_id, None)
        final = stats or last
        if final is not None:
            self._closed.append(final)

    def current(self, end: float | None = None) -> RunStats:
        total = RunStats.merged([self._base, *self._closed, *self._running.values()])
        total.start, total.end = self.start, end
        return total

    def finish(self) -> RunStats:
        return self.current(end=time.perf_counter())


@dataclass
class ReplicaFigures:
    """One replica over the job's run: the windows it finished and what it did in them."""

    index: int
    info: dict[str, Any]
    windows: int = 0
    rows: int = 0
    lost: bool = False
    stats: list[RunStats] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        merged = RunStats.merged(self.stats).as_dict()
        figures = {name: merged[name] for name in REPLICA_FIELDS}
        where = {k: self.info.get(k) for k in ("node", "node_id", "rank_nodes", "pid", "device")}
        return {"replica": self.index, **where, "windows": self.windows, "rows": self.rows,
                "lost": self.lost, **figures}  # fmt: skip
