"""Run metrics, with the names of docs/design.md (llm.stats and run.json).

One RunStats per generate() call; a job that generates window by window merges them with
`RunStats.merged`, so llm.stats and run.json have the same keys, computed by the same code.
Throughput is defined once: generated tokens over the wall time spent generating.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# RunStats fields that add up over runs, and those that take the maximum.
_SUMMED = (
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "prefill_tokens_computed",
    "cached_prompt_tokens",
    "preemptions",
    "swaps",
    "steps",
    "used_slot_steps",
    "reserved_slot_steps",
    "draft_tokens",
    "accepted_draft_tokens",
)
_PEAKS = ("peak_running", "peak_kv_blocks_used")
# The parts of an engine step, timed apart (RunStats.step_time_s). On a device that runs
# asynchronously (CUDA) the forward's time lands where the host first waits for its result.
STEP_PARTS = ("schedule", "inputs", "forward", "sample", "stop_checks", "commit", "draft")


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


@dataclass
class RunStats:
    """Collects one generate() call's figures. The engine records; `as_dict` reports."""

    kv_blocks_total: int
    block_size: int
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens_computed: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    swaps: int = 0  # preemptions that moved K/V to host memory (preemption_mode=swap)
    peak_running: int = 0
    peak_kv_blocks_used: int = 0
    steps: int = 0
    used_slot_steps: int = 0
    reserved_slot_steps: int = 0
    # Speculative decoding: drafted tokens run, and those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    first_token_s: list[float] = field(default_factory=list)
    # Seconds spent in each of STEP_PARTS, summed over the run's steps.
    step_time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    # What the engine's model holds (CausalLM.weight_bytes, weight_formats), fixed at setup.
    weight_bytes: int = 0
    weight_formats: dict[str, int] = field(default_factory=dict)
    linear_methods: dict[str, str] = field(default_factory=dict)  # per linear shape
    # How those were chosen and the load they were measured under (MeasuredLinears.report).
    linear_measurement: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def merged(cls, runs: Sequence[RunStats]) -> RunStats:
        """Several runs as one: counts add up, peaks take the maximum, the elapsed times add up
        (so rates are over the time spent generating), and each run's time-to-first-token
        samples (measured from its own start) are pooled."""
        total = cls(
            kv_blocks_total=max((r.kv_blocks_total for r in runs), default=0),
            block_size=runs[0].block_size if runs else 0,
            start=0.0,
            end=sum(r.elapsed_s for r in runs),
        )
        for name in _SUMMED:
            setattr(total, name, sum(getattr(r, name) for r in runs))
        for name in _PEAKS:
            setattr(total, name, max((getattr(r, name) for r in runs), default=0))
        total.first_token_s = [t for r in runs for t in r.first_token_s]
        total.step_time_s = {p: sum(r.step_time_s[p] for r in runs) for p in STEP_PARTS}
        if runs:  # every run of one job loads the same model
            total.weight_bytes = runs[-1].weight_bytes
            total.weight_formats = dict(runs[-1].weight_formats)
            total.linear_methods = dict(runs[-1].linear_methods)
            total.linear_measurement = dict(runs[-1].linear_measurement)
        return total

    def to_record(self) -> dict[str, Any]:
        """The counters, JSON-able, for a job's run history: `from_record` restores a RunStats
        that merges like the original (time-to-first-token samples are not kept)."""
        record: dict[str, Any] = {n: getattr(self, n) for n in (*_SUMMED, *_PEAKS)}
        parts = {f"step_time_s.{p}": self.step_time_s[p] for p in STEP_PARTS}
        return {
            **record, **parts, "kv_blocks_total": self.kv_blocks_total,
            "elapsed_s": self.elapsed_s, "weight_bytes": self.weight_bytes,
            "weight_formats": dict(self.weight_formats),
            "linear_methods": dict(self.linear_methods),
            "linear_measurement": dict(self.linear_measurement),
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: dict[str, Any], block_size: int) -> RunStats:
        stats = cls(int(record["kv_blocks_total"]), block_size, 0.0, float(record["elapsed_s"]))
        for name in (*_SUMMED, *_PEAKS):
            setattr(stats, name, int(record.get(name, 0)))
        for part in STEP_PARTS:
            stats.step_time_s[part] = float(record.get(f"step_time_s.{part}", 0.0))
        stats.weight_bytes = int(record.get("weight_bytes", 0))
        formats = record.get("weight_formats", {})
        stats.weight_formats = dict(formats) if isinstance(formats, dict) else {}
        methods = record.get("linear_methods", {})
        stats.linear_methods = dict(methods) if isinstance(methods, dict) else {}
        measurement = record.get("linear_measurement", {})
        stats.linear_measurement = dict(measurement) if isinstance(measurement, dict) else {}
        return stats

    def record_step(
        self, num_running: int, used_slots: int, reserved_slots: int, blocks_used: int
    ) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, num_running)
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, blocks_used)
        self.used_slot_steps += used_slots
        self.reserved_slot_steps += reserved_slots

    def record_first_token(self) -> None:
        self.first_token_s.append(time.perf_counter() - self.start)

    def finish(self) -> None:
        """Stops the clock; later calls keep the first end."""
        if self.end is None:
            self.end = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kv_utilization(self) -> float:
        if not self.reserved_slot_steps:
            return 0.0
        return self.used_slot_steps / self.reserved_slot_steps

    def as_dict(self) -> dict[str, Any]:
        elapsed = self.elapsed_s
        return {
            "elapsed_s": self.elapsed_s,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tokens_per_s": tokens_per_s(self.generated_tokens, elapsed),
            "total_tokens_per_s": tokens_per_s(self.prompt_tokens + self.generated_tokens, elapsed),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_hit_rate": self.prefix_hit_rate,
            "preemptions": self.preemptions,
            "swaps": self.swaps,
            "peak_running": self.peak_running,
            "peak_kv_blocks_used": self.peak_kv_blocks_used,
            "kv_blocks_total": self.kv_blocks_total,
            "kv_utilization": self.kv_utilization,
            "kv_waste": 1.0 - self.kv_utilization if self.reserved_slot_steps else 0.0,
            "ttft_s": {
                "p50": percentile(self.first_token_s, 50),
                "p90": percentile(self.first_token_s, 90),
            },
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "step_time_s": dict(self.step_time_s),
            "weight_bytes": self.weight_bytes,
            "weight_formats": dict(self.weight_formats),
            "linear_methods": dict(self.linear_methods),
            "linear_measurement": dict(self.linear_measurement),
        }
