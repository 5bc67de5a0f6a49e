"""The Triton attention backend: the kernels of batchpage.kernels behind the AttentionBackend
protocol (see backend.py and metadata.py for the contract).

The plan picks the kernel for the step: the decode kernel when every sequence has exactly one new
token, the extend kernel otherwise (it also serves decode rows mixed into a prefill step). In
batch-invariant mode every step goes to the extend kernel, whose rows are the same bits however
a prompt was split and whatever the batch (extend_attention.py); the decode kernel splits a long
context into as many partitions as the batch leaves room for. Per
layer: write the new tokens' K/V into their slots, then one attention launch over the whole batch.
Both kernels take the layer's sliding window (reading only the blocks inside it) and logit
soft-cap, with the meaning backend.py gives them. A step's sequences whose image rows see their
whole span (AttentionMetadata.span_seqs: Gemma 3) have their rows overwritten after the extend
kernel by the torch parts, which allow it (spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.spans import SpanParts
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.extend_attention import extend_attention
from batchpage.kernels.kv_write import write_kv
from batchpage.kernels.paged_decode_attention import paged_decode_attention


@dataclass(frozen=True)
class TritonStepAttention:
    """A step planned by TritonPagedAttention: which kernel serves it and the host-side bounds
    the kernels size their grids with, read once rather than per layer."""

    meta: AttentionMetadata
    kernel: Literal["decode", "extend", "none"]  # none: the step has no rows
    max_seqlen_k: int
    max_seqlen_q: int
    num_splits: int  # decode split-KV partitions, 0 = chosen per launch from the shapes
    spans: SpanParts | None = None  # the sequences whose rows see past themselves (spans.py)

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
        assert meta.block_size == k_cache.shape[1], "metadata and pool disagree on block_size"
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The kernels multiply q by K in the pool's dtype and want a unit head_dim stride.
        q_in = q.to(k_cache.dtype)
        if q_in.stride(-1) != 1:
            q_in = q_in.contiguous()
        if self.kernel == "none":
            return torch.empty_like(q)
        if self.kernel == "decode":
            out = paged_decode_attention(
                q_in,
                k_cache,
                v_cache,
                meta.seq_lens,
                meta.block_tables,
                softmax_scale=scale,
                max_seqlen_k=self.max_seqlen_k,
                num_splits=self.num_splits,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        else:
            out = extend_attention(
                q_in,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                max_seqlen_q=self.max_seqlen_q,
                softmax_scale=scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
            if self.spans is not None:
                self.spans.attend(q_in, k_cache, v_cache, sliding_window, scale, out, logit_softcap)
        return out.to(q.dtype)


class TritonPagedAttention:
    """AttentionBackend over the paged pool with Triton kernels.

    num_splits: decode split-KV partitions, 0 = chosen per step from batch and context length
    (see paged_decode_attention.choose_num_splits), 1 = always single-pass.
    batch_invariant: every step on the extend kernel (see the module's docstring).
    """

    def __init__(self, num_splits: int = 0, batch_invariant: bool = False) -> None:
        self.num_splits = num_splits
        self.batch_invariant = batch_invariant

    def plan(self, meta: AttentionMetadata) -> TritonStepAttention:
        kernel: Literal["decode", "extend", "none"]
        if meta.num_tokens == 0:
            kernel = "none"
        elif meta.is_decode_only and not self.batch_invariant:
            assert meta.num_tokens == meta.num_seqs, "decode steps carry one token per sequence"
            kernel = "decode"
        else:
            kernel = "extend"
        return TritonStepAttention(
            meta,
            kernel=kernel,
            max_seqlen_k=meta.max_seq_len,
            max_seqlen_q=meta.max_query_len,
            num_splits=self.num_splits,
            spans=SpanParts.of(meta),
        )
