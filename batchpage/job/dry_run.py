"""Dry run: the job's shape (rows, prompt tokens, shared prefixes, KV blocks) before any
generation. Tokenizes every row with the model's tokenizer; loads no weights."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, NamedTuple

from batchpage.data.spec import iter_windows
from batchpage.job.config import JobConfig
from batchpage.job.plan import plan_job
from batchpage.job.prompts import prepare_window
from batchpage.model.loader import load_tokenizer


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
    """Tokenize every row with the model's tokenizer (no weights) and report the job's shape."""
    plan = plan_job(cfg)
    tokenizer = load_tokenizer(plan.source)
    bs, limit = cfg.engine.block_size, plan.engine.max_model_len
    packed: list[bytes] = []
    rows = bad = too_long = 0
    blocks_max = blocks_all = blocks_prompt_full = 0
    for window in iter_windows(cfg.dataset, plan.info):
        rows += len(window)
        ready, failed = prepare_window(
            window, tokenizer, plan.params, plan.base_seed, plan.prompts, plan.adapters
        )
        bad += len(failed)
        for p in ready:
            ids = p.prompt_ids
            if not ids or len(ids) >= limit:
                too_long += bool(ids)
                bad += not ids
                continue
            packed.append(pack_tokens(ids))
            out_len = min(p.params.max_tokens or limit, limit - len(ids))
            seq_blocks = math.ceil((len(ids) + out_len) / bs)
            full = len(ids) // bs  # a request's n samples share its full prompt blocks
            blocks_max = max(blocks_max, seq_blocks)
            blocks_all += p.params.n * seq_blocks
            blocks_prompt_full += (p.params.n - 1) * full
    prefix = shared_prefix_stats(packed, bs)
    hit = (prefix.total_tokens - prefix.unique_tokens) / prefix.total_tokens if packed else 0.0
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
        "kv_blocks_all_rows_shared": blocks_all - blocks_prompt_full - prefix.shared_blocks,
        "kv_blocks_pool": plan.engine.num_blocks,
    }
