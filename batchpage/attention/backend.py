"""The attention backend interface shared by the torch and Triton implementations."""

from __future__ import annotations

from typing import Protocol

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], the new tokens' keys (RoPE applied)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v at meta.slot_mapping in layer `layer` of the pool, then attend each query row
        causally over its sequence's paged context (see metadata.py)."""
        ...
