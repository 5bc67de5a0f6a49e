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
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v at meta.slot_mapping in layer `layer` of the pool, then attend each query row
        causally over its sequence's paged context (see metadata.py).

        sliding_window W: the row at position p sees the keys at positions k with
        p - W < k <= p, its last W positions with itself included. That is HF transformers'
        sliding_window_overlay (kv_idx > q_idx - sliding_window) for Mistral, Qwen2 and Gemma
        2/3. The backends read only the blocks from the earliest row's window start on.
        Every layer still keeps every block of its sequence: the KV manager's accounting and the
        prefix cache are per sequence, not per layer, so a cached block holds every layer's K/V
        whatever span each layer attends to (the cost: out-of-window blocks are not freed early).

        logit_softcap c: scores (q.k * scale) become c * tanh(scores / c) before the mask and
        the softmax (Gemma 2's attn_logit_softcapping).
        """
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


def check_window_and_softcap(sliding_window: int | None, logit_softcap: float | None) -> None:
    """A window of 0 or a cap of 0 would silently mean something else in the kernels (no
    window, a division by zero): refuse them with what is expected."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(
            f"sliding_window must be a positive number of positions or None, got {sliding_window!r}"
        )
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap!r}")
