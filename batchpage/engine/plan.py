"""plan_engine: what an engine will be (device, dtype, max_model_len, KV blocks), from the config
and the model's config alone. LLM(...) and the job both call it, so a bad setting or a pool too
small fails here, before any weight is read, and both agree on every figure."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.config import EngineConfig
from batchpage.model.loader import ModelSource, resolve_dtype


class PoolTooSmall(ValueError):
    pass


@dataclass(frozen=True)
class EnginePlan:
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # positions per sequence, prompt and completion together
    num_blocks: int  # KV blocks in the pool
    kv_cache_bytes: int  # the budget the blocks were cut from


def plan_engine(cfg: EngineConfig, source: ModelSource) -> EnginePlan:
    """Raises ValueError (PoolTooSmall for the pool) naming the setting to change."""
    model_cfg = source.config
    device = cfg.resolved_device()
    dtype = resolve_dtype(cfg.dtype, model_cfg, device)
    limit = model_cfg.max_model_len  # positions the model's rope supports
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit} "
            "positions (max_position_embeddings, extended by its rope scaling): lower "
            "max_model_len"
        )
    max_model_len = cfg.max_model_len or limit
    per_block = bytes_per_block(
        model_cfg.num_layers, cfg.block_size, model_cfg.num_kv_heads, model_cfg.head_dim, dtype
    )
    budget = kv_cache_bytes(cfg.kv_cache_memory, device)
    num_blocks = budget // per_block
    needed = -(-max_model_len // cfg.block_size)
    if num_blocks < needed:
        raise PoolTooSmall(
            f"the KV pool ({budget / 2**20:.1f} MiB = {num_blocks} blocks of {cfg.block_size} "
            f"tokens) cannot hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed} blocks, {needed * per_block / 2**20:.1f} MiB): raise kv_cache_memory or "
            "lower max_model_len"
        )
    return EnginePlan(device, dtype, max_model_len, num_blocks, budget)


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_bytes(kv_cache_memory: float | None, device: torch.device) -> int:
    """Bytes (> 1) as given, or that fraction of free memory; None: 0.9 of free GPU memory, or
    0.1 of available RAM on the CPU."""
    if kv_cache_memory is not None and kv_cache_memory > 1:
        return int(kv_cache_memory)
    fraction = (
        kv_cache_memory if kv_cache_memory is not None else (0.9 if device.type == "cuda" else 0.1)
    )
    return int(available_memory(device) * fraction)
