"""Bidirectional image spans on the backends whose kernels attend causally only (CPU, Triton): a
step's sequences with a row that sees past itself (AttentionMetadata.span_seqs, key_end) attend
through the torch parts instead (parts.py, whose masks read key_end), the one path every
backend shares for them. Text steps, and the image steps of families whose images attend
causally, never come here: their metadata has no span sequences.

The CPU backend leaves those sequences out of its prefill kernel; the Triton backend runs its
extend kernel over the whole step and then overwrites their rows (one launch for the step
either way; the span rows it computed causally are thrown away).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import AttentionPart, attend_parts, extend_parts


@dataclass
class SpanParts:
    """The span sequences' parts of one step, planned per sliding window on the first layer that
    uses it, as StepParts plans a whole step's."""

    meta: AttentionMetadata
    planned: dict[int | None, list[AttentionPart]] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: AttentionMetadata) -> SpanParts | None:
        """The step's span sequences; None when it has none (every row causal)."""
        return cls(meta) if meta.span_seqs else None

    def attend(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        window: int | None,
        scale: float,
        out: torch.Tensor,  # [T, num_heads, head_dim]: the span sequences' rows are written
        softcap: float | None = None,
    ) -> None:
        """One layer's attention for the span sequences' rows (their K/V already in the pool)."""
        if window is not None and window >= self.meta.max_seq_len:
            window = None  # the same parts as full attention: plan them once
        if window not in self.planned:
            self.planned[window] = extend_parts(self.meta, list(self.meta.span_seqs), window)
        attend_parts(q, k_cache, v_cache, self.planned[window], scale, out, softcap)
