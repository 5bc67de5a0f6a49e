"""Dry run: the job's shape (rows, prompt tokens, shared prefixes, KV blocks and bytes) before
any generation, with its capacity plan (memory, preemption, and with plan.devices its wall time:
batchpage/job/capacity.py). Tokenizes every row with the model's tokenizer; loads no weights
unless the plan must run the model (a calibration, sampled output lengths). Rows' images are
read and decoded as the job would (a bad one counts among the rows with errors) and placed by
the model's image processor: prompt tokens count each image's placeholders as the engine
expands them, and rows share an image's positions only with rows of the same picture, as the
engine's prefix cache does."""

from __future__ import annotations

import heapq
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict
from itertools import pairwise
from typing import Any, NamedTuple

from batchpage.data.spec import iter_windows
from batchpage.engine.config import EngineConfig
from batchpage.job.capacity import job_capacity, window_rows
from batchpage.job.config import JobConfig
from batchpage.job.plan import plan_job
from batchpage.job.prompts import prepare_window
from batchpage.job.row_images import placed_prompt
from batchpage.model.image_prompt import ImagePrompts
from batchpage.model.loader import load_tokenizer
from batchpage.simulate.capacity import WindowSample
from batchpage.simulate.memory import plan_pool


class PrefixStats(NamedTuple):
    prompts: int
    total_tokens: int
    shared_tokens: int  # tokens inside a prefix that some other prompt shares
    unique_tokens: int  # distinct prefix tokens (a radix tree's size): prefilled at least once
    longest_shared_prefix: int
    shared_blocks: int  # full KV blocks a paged prefix cache can lend (block-aligned sharing)


def pack_tokens(ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte big-endian words: bytes sort exactly like the id lists, and take
    a fraction of a Python list's memory."""
    return struct.pack(f">{len(ids)}I", *ids)


def _lcp_tokens(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b)) // 4  # binary search: each probe is one memcmp
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 4 * mid] == b[: 4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_prefix_stats(packed: Sequence[bytes], block_size: int) -> PrefixStats:
    """Shared-prefix counts by sorted-neighbour longest common prefixes (exact: in sorted order a
    prompt's longest common prefix with any other prompt is with a neighbour)."""
    ordered = sorted(packed)
    lcp = [_lcp_tokens(a, b) for a, b in pairwise(ordered)]  # lcp[i]: i and i + 1
    total = sum(len(p) for p in ordered) // 4
    shared = sum(
        max(lcp[i - 1] if i > 0 else 0, lcp[i] if i < len(lcp) else 0) for i in range(len(ordered))
    )
    return PrefixStats(
        prompts=len(ordered),
        total_tokens=total,
        shared_tokens=shared,
        unique_tokens=total - sum(lcp),
        longest_shared_prefix=max(lcp, default=0),
        shared_blocks=sum(x // block_size for x in lcp),
    )


def dry_run(cfg: JobConfig) -> dict[str, Any]:
    """Tokenize every row with the model's tokenizer (no weights) and report the job's shape,
    the KV bytes its rows need against the pool's, its peak memory and its schedule on this
    machine (preemptions), with warnings; with plan.devices, its wall time there too (see
    batchpage/job/capacity.py: the model loads only for a calibration or sampled lengths)."""
    started = time.perf_counter()
    plan = plan_job(cfg)
    tokenizer = load_tokenizer(plan.source)  # the job's engine loads it too
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    bs, limit = cfg.engine.block_size, plan.engine.max_model_len
    packed: list[bytes] = []
    rows = bad = too_long = 0
    blocks_max = blocks_all = blocks_prompt_full = 0
    sample = WindowSample(cfg.plan.simulated_rows, cfg.dataset.window_rows)
    longest: list[int] = []  # the max_num_seqs longest sequences' blocks (a heap)
    # A vision-language model's image processor and placeholder rule (its files, no weights).
    image_prompts = None
    if plan.prompts.image_limits is not None:
        image_prompts = ImagePrompts.from_model(plan.source.path, plan.source.config)
    for window in iter_windows(cfg.dataset, plan.info, plan.stores):
        rows += len(window)
        ready, failed = prepare_window(
            window, tokenizer, plan.params, plan.base_seed, plan.prompts, plan.adapters
        )
        bad += len(failed)
        kept = []
        for p in ready:
            ids = key = p.prompt_ids
            if p.images:
                assert image_prompts is not None  # prepare_window decodes for such a job only
                try:
                    ids, key = placed_prompt(image_prompts, p.prompt_ids, p.images)
                except ValueError:  # placeholders that are not the images: the engine's error
                    bad += 1
                    continue
                # The simulator runs the expanded ids (its cache cannot tell the pictures apart).
                p = p._replace(prompt_ids=ids, images=())
            if not ids or len(ids) >= limit:
                too_long += bool(ids)
                bad += not ids
                continue
            kept.append(p)
            packed.append(pack_tokens(key))
            out_len = min(p.params.max_tokens or limit, limit - len(ids))
            seq_blocks = math.ceil((len(ids) + out_len) / bs)
            full = len(ids) // bs  # a request's n samples share its full prompt blocks
            blocks_max = max(blocks_max, seq_blocks)
            blocks_all += p.params.n * seq_blocks
            blocks_prompt_full += (p.params.n - 1) * full
            for _ in range(min(p.params.n, cfg.engine.max_num_seqs)):
                keep_largest(longest, seq_blocks, cfg.engine.max_num_seqs)
        if kept:
            sample.add(window_rows(kept, plan.engine.task))
    prefix = shared_prefix_stats(packed, bs)
    hit = (prefix.total_tokens - prefix.unique_tokens) / prefix.total_tokens if packed else 0.0
    io_s = time.perf_counter() - started
    block = plan_pool(plan.engine, EngineConfig(**asdict(cfg.engine)), plan.source.config)
    block_bytes = block.block_bytes * cfg.engine.tensor_parallel_size  # every rank's share
    shared_blocks = blocks_all - blocks_prompt_full - prefix.shared_blocks
    capacity = job_capacity(cfg, plan, sample, setup_s, io_s, sum(longest), shared_blocks)
    return {
        "rows": rows,
        "rows_to_generate": len(packed),
        "rows_with_errors": bad,
        "rows_over_max_model_len": too_long,
        "max_model_len": limit,
        "prompt_tokens": prefix.total_tokens,
        "prompt_tokens_max": max((len(p) // 4 for p in packed), default=0),
        "shared_prefix_tokens": prefix.shared_tokens,
        "unique_prefix_tokens": prefix.unique_tokens,
        "longest_shared_prefix": prefix.longest_shared_prefix,
        "best_prefix_hit_rate": hit,
        "kv_block_size": bs,
        "kv_blocks_longest_sequence": blocks_max,
        "kv_blocks_all_rows_no_sharing": blocks_all,
        "kv_blocks_all_rows_shared": shared_blocks,
        "kv_blocks_pool": plan.engine.num_blocks,
        "kv_bytes_per_block": block_bytes,
        "kv_bytes_all_rows_no_sharing": blocks_all * block_bytes,
        "kv_bytes_all_rows_shared": shared_blocks * block_bytes,
        "kv_bytes_pool": plan.engine.num_blocks * block_bytes,
        **capacity,
    }


def keep_largest(heap: list[int], value: int, count: int) -> None:
    """Keep the `count` largest values pushed so far in `heap` (a min-heap)."""
    if len(heap) < count:
        heapq.heappush(heap, value)
    elif value > heap[0]:
        heapq.heapreplace(heap, value)


def format_report(report: dict[str, Any], indent: int = 0) -> list[str]:
    """The report as aligned `key  value` lines: nested groups indented under their key, lists
    of groups (the devices) one after another, byte counts also in MiB or GiB, seconds to
    0.1, rates as percentages. The warnings are not among them (the caller shows those)."""
    shown = {k: v for k, v in report.items() if k != "warnings"}
    width = max(map(len, shown), default=0)
    pad = " " * indent
    lines = []
    for key, value in shown.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key}", *format_report(value, indent + 2)]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{key}")
            for item in value:
                lines += format_report(item, indent + 2)
        else:
            lines.append(f"{pad}{key:<{width}}  {_shown(key, value)}")
    return lines


# The memory parts (simulate/memory.py Memory), shown as byte counts.
_MEMORY_PARTS = (
    "weights",
    "kv_pool",
    "activations",
    "workers",
    "runtime",
    "device_memory",
    "total",
)


def _shown(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str | list):
        return str(value)
    if key.endswith("_rate"):
        return f"{value:.1%}"
    if isinstance(value, int) and ("bytes" in key or key in _MEMORY_PARTS):
        return f"{value:,} ({_size(value)})"
    if isinstance(value, float) and (key.endswith("_s") or "seconds" in key):
        return f"{value:,.1f}"
    return f"{value:,.3g}" if isinstance(value, float) else f"{value:,}"


def _size(value: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value} B"
