"""The Triton attention backend: the kernels of batchpage.kernels behind the AttentionBackend
protocol (see backend.py and metadata.py for the contract).

Per layer and step: write the new tokens' K/V into their slots, then one attention launch over the
whole batch: the decode kernel when every sequence has exactly one new token, the extend kernel
otherwise (it also serves decode rows mixed into a prefill step).
"""

from __future__ import annotations

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.extend_attention import extend_attention
from batchpage.kernels.kv_write import write_kv
from batchpage.kernels.paged_decode_attention import paged_decode_attention


class TritonPagedAttention:
    """AttentionBackend over the paged pool with Triton kernels.

    num_splits: decode split-KV partitions, 0 = chosen per step from batch and context length
    (see paged_decode_attention.choose_num_splits), 1 = always single-pass.
    """

    def __init__(self, num_splits: int = 0) -> None:
        self.num_splits = num_splits

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        assert meta.block_size == k_cache.shape[1], "metadata and pool disagree on block_size"
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # The kernels multiply q by K in the pool's dtype and want a unit head_dim stride.
        q_in = q.to(k_cache.dtype)
        if q_in.stride(-1) != 1:
            q_in = q_in.contiguous()
        if meta.num_tokens == 0:
            return torch.empty_like(q)
        if meta.is_decode_only:
            assert meta.num_tokens == meta.num_seqs, "decode steps carry one token per sequence"
            out = paged_decode_attention(
                q_in,
                k_cache,
                v_cache,
                meta.seq_lens,
                meta.block_tables,
                softmax_scale=scale,
                max_seqlen_k=meta.max_seq_len,
                num_splits=self.num_splits,
            )
        else:
            out = extend_attention(
                q_in,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                max_seqlen_q=meta.max_query_len,
                softmax_scale=scale,
            )
        return out.to(q.dtype)
