"""Torch references for the Triton kernels: plain gathers and a float32 softmax, one sequence at a
time, written to be obviously right rather than fast.

They index only the blocks a sequence owns, so they also work on a pool that is mostly untouched
virtual memory (the overflow tests allocate > 2**31 elements and write a few blocks).
"""

from __future__ import annotations

import torch


def ref_write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]; slot < 0 means "do not store" (padding token)
) -> None:
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def gather_sequence(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    table_row: torch.Tensor,  # int32 [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # float32 [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[table_row[:num_blocks].long()]  # [nb, block_size, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len].float()


def ref_paged_attention(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    seqused_k: torch.Tensor,  # int32 [B]: context length including the new tokens
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    softmax_scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [total_q, num_heads, head_dim], q's dtype
    """Each sequence's q rows are the last q_len positions of its context; row i (position
    p = seq_len - q_len + i) sees keys 0..p when causal, all seq_len keys otherwise.

    sliding_window W (causal only): row p sees only keys k with p - W < k <= p, its last W
    positions itself included (HF's sliding_window_overlay: kv_idx > q_idx - W).
    logit_softcap c: scores become c * tanh(scores / c) after the scale, before the mask (Gemma
    2's attn_logit_softcapping)."""
    assert sliding_window is None or (causal and sliding_window > 0), sliding_window
    num_heads, head_dim = q.shape[1:]
    group = num_heads // key_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seqused_k.tolist()):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or seq_len == 0:
            continue
        # query head h reads kv head h // group (the repeat_interleave convention of HF Llama)
        k = gather_sequence(key_cache, block_table[b], seq_len).repeat_interleave(group, dim=1)
        v = gather_sequence(value_cache, block_table[b], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].float(), k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        if causal:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            hidden = k_pos > q_pos
            if sliding_window is not None:
                hidden |= k_pos <= q_pos - sliding_window
            scores = scores.masked_fill(hidden[None], float("-inf"))
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)


def ref_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cache_seqlens: torch.Tensor,  # int32 [B]
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return ref_paged_attention(
        q, key_cache, value_cache, cu, cache_seqlens, block_table, softmax_scale, causal=True,
        sliding_window=sliding_window, logit_softcap=logit_softcap,
    )  # fmt: skip
