"""The attention backend interface shared by the torch, CPU and Triton implementations.

A step's attention runs in two stages. Before the forward, the model runner calls
`backend.plan(meta)` once: everything that depends only on the step's metadata (which rows attend
together, which blocks they read, which kernel serves them) is worked out there. The plan it
returns is the step's attention, which the model calls once per layer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache


class StepAttention(Protocol):
    """One step's attention, planned from its metadata; valid for that step only."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], the new tokens' keys (RoPE applied)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,  # the metadata the step was planned for
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v at meta.slot_mapping in layer `layer` of the pool, then attend each query row
        causally over its sequence's paged context (see metadata.py)."""
        ...


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> StepAttention:
        """The step's attention for every layer, planned once from its metadata."""
        ...


def check_planned_for(planned: AttentionMetadata, meta: AttentionMetadata) -> None:
    """A plan describes one step's rows and blocks: applied to another step's metadata it would
    attend the wrong rows without any error, so refuse it here."""
    if meta is not planned:
        raise ValueError(
            "attention was called with metadata it was not planned for: call "
            "backend.plan(meta) for each step and use its result for that step's layers"
        )
