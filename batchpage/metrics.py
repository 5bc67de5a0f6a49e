"""Run metrics, with the names of docs/design.md (llm.stats and run.json).

One RunStats per generate() call; a job that generates window by window merges them with
`RunStats.merged`, so llm.stats and run.json have the same keys, computed by the same code.
Throughput is defined once: generated tokens over the wall time spent generating.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Samples per sealed block of `Samples`: large enough that a block's own object is a small share
# of it, small enough that the unsealed tail (a list) stays small.
SAMPLES_BLOCK = 4096


class Samples:
    """Float samples in the order recorded (a run's time-to-first-token figures, one per
    request), exact: sealed float64 blocks of SAMPLES_BLOCK plus a short list being filled. A
    job pools every request's figure, so what it holds grows with its rows: a float64 a sample
    here, where a list holds a float object and a pointer to it. Absorbing another Samples
    shares its sealed blocks (never changed once sealed) instead of copying them."""

    __slots__ = ("_blocks", "_tail", "_sealed")

    def __init__(self, values: Iterable[float] = ()) -> None:
        self._blocks: list[np.ndarray] = []
        self._sealed = 0  # samples in _blocks
        self._tail: list[float] = []
        self.extend(values)

    def append(self, value: float) -> None:
        self._tail.append(value)
        if len(self._tail) >= SAMPLES_BLOCK:
            self._seal()

    def extend(self, values: Iterable[float]) -> None:
        """Append every value of `values` (another Samples: its blocks are shared)."""
        if not isinstance(values, Samples):
            for value in values:
                self.append(value)
            return
        blocks, tail = list(values._blocks), list(values._tail)  # `values` may be self
        for block in blocks:
            self._seal()  # the order recorded: what is in the tail came first
            self._blocks.append(block)
            self._sealed += len(block)
        for value in tail:
            self.append(value)

    def array(self) -> np.ndarray:
        """Every sample as one float64 array (a copy)."""
        return np.concatenate([*self._blocks, np.array(self._tail, dtype=np.float64)])

    def check_integrity(self) -> None:
        assert self._sealed == sum(len(b) for b in self._blocks), "sealed count"
        assert len(self._tail) < SAMPLES_BLOCK, "an unsealed full tail"
        assert all(b.dtype == np.float64 and b.ndim == 1 and len(b) for b in self._blocks)

    def __len__(self) -> int:
        return self._sealed + len(self._tail)

    def __iter__(self) -> Iterator[float]:
        for block in self._blocks:
            yield from block.tolist()
        yield from self._tail

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Samples):
            other = other.array()
        elif isinstance(other, (list, tuple)):
            other = np.array(other, dtype=np.float64)
        else:
            return NotImplemented
        return bool(np.array_equal(self.array(), other))

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Samples({len(self)} values)"

    def _seal(self) -> None:
        if self._tail:
            self._blocks.append(np.array(self._tail, dtype=np.float64))
            self._sealed += len(self._tail)
            self._tail = []


def percentile(values: Sequence[float] | Samples, q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    data = values.array() if isinstance(values, Samples) else np.asarray(values, np.float64)
    if not len(data):
        return 0.0
    rank = max(0, min(len(data) - 1, round(q / 100 * len(data) + 0.5) - 1))
    return float(np.partition(data, rank)[rank])


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
    "images_encoded",
    "encoder_cache_hits",
    "encoder_disk_hits",
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
    # Images: those the vision tower encoded, image uses served by its rows kept in memory, and
    # images whose rows were read from encoder_cache_dir.
    images_encoded: int = 0
    encoder_cache_hits: int = 0
    encoder_disk_hits: int = 0
    # Each request's seconds from the run's start to its first token (a list assigned here
    # is taken as it is).
    first_token_s: Samples | list[float] = field(default_factory=Samples)
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
        total = cls(kv_blocks_total=0, block_size=runs[0].block_size if runs else 0, start=0.0)
        total.end = 0.0
        for run in runs:
            total.absorb(run)
        return total

    def absorb(self, run: RunStats) -> None:
        """Merge `run` into this merged total (one of `merged`, then absorbing run after run),
        in place: `merged([*runs, run])` without going over the runs again, for a job that
        merges its windows as they finish. The run's sealed samples are shared, not copied."""
        assert self.start == 0.0 and self.end is not None, "absorb into a merged total"
        if not self.block_size:
            self.block_size = run.block_size
        self.kv_blocks_total = max(self.kv_blocks_total, run.kv_blocks_total)
        self.end += run.elapsed_s
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(run, name))
        for name in _PEAKS:
            setattr(self, name, max(getattr(self, name), getattr(run, name)))
        if not isinstance(self.first_token_s, Samples):
            self.first_token_s = Samples(self.first_token_s)
        self.first_token_s.extend(run.first_token_s)
        self.step_time_s = {p: self.step_time_s[p] + run.step_time_s[p] for p in STEP_PARTS}
        # Every run of one job loads the same model: the last run's figures stand.
        self.weight_bytes = run.weight_bytes
        self.weight_formats = dict(run.weight_formats)
        self.linear_methods = dict(run.linear_methods)
        self.linear_measurement = dict(run.linear_measurement)

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
            "images_encoded": self.images_encoded,
            "encoder_cache_hits": self.encoder_cache_hits,
            "encoder_disk_hits": self.encoder_disk_hits,
            "step_time_s": dict(self.step_time_s),
            "weight_bytes": self.weight_bytes,
            "weight_formats": dict(self.weight_formats),
            "linear_methods": dict(self.linear_methods),
            "linear_measurement": dict(self.linear_measurement),
        }
