"""The torch attention backend: paged attention in plain torch, the backend of last resort on any
device and the reference for the kernels. Its plan is the step's parts (parts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import StepParts, attend_parts
from batchpage.cache.kv_cache import KVCache


def write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T], every slot >= 0
) -> None:
    """Store the new tokens' K/V at their slots, in torch: batchpage.kernels.kv_write.write_kv's
    arguments and result, without its padding slots (< 0), which the engine never makes."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


@dataclass(frozen=True)
class TorchStepAttention:
    """A step planned by TorchPagedAttention: every row attends through its part, planned per
    sliding window on the first layer that uses it."""

    meta: AttentionMetadata
    parts: StepParts

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        check_planned_for(self.meta, meta)
        check_window_and_softcap(sliding_window, logit_softcap)
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        attend_parts(q, k_cache, v_cache, self.parts(sliding_window), scale, out, logit_softcap)
        return out


class TorchPagedAttention:
    """AttentionBackend over the paged pool, in torch (see backend.py for the contract)."""

    def plan(self, meta: AttentionMetadata) -> TorchStepAttention:
        return TorchStepAttention(meta, StepParts(meta))
