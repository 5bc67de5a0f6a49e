"""Paged decode attention: one query token per sequence against its whole paged context.

Decode reads every cached K/V byte once and does little math with it, so the kernels are built to
stream memory:
- one program per (sequence, KV head) serves all `group = num_heads // num_kv_heads` query heads
  of that KV head (GQA/MQA), so each K/V tile is loaded once and used for `group` rows of a tl.dot;
- the single-pass kernel walks the context in BLOCK_N-token tiles with an online softmax;
- when batch * num_kv_heads programs cannot fill the GPU (small batch, long context), the split-KV
  kernel also splits each context into partitions that run in parallel, each writing a normalised
  partial output and its log-sum-exp; a merge kernel combines them with the usual stable rescale
  (weights exp2(lse_i - max lse)).

Tiles are independent of the page size: each token's page is looked up in the block table, so
block sizes 8, 16, 32 and larger all work with the same tile (see common.paged_token_offsets).

A sliding window W makes the query (position seq_len - 1) see only its last W positions,
[seq_len - W, seq_len): the kernels walk that span alone, so the blocks before it are never read,
and the split-KV partitions divide the span rather than the whole context. A logit soft-cap c
turns each score s into c * tanh(s / c) before the softmax.
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import (
    LOG2E,
    check_block_table,
    check_kv_cache,
    check_runnable,
    dot,
    dot_precision,
    kernel_softcap,
    kernel_window,
    next_pow2,
    padded_dim,
    paged_token_offsets,
    soft_cap,
    softmax_step,
)

# isort: split
import triton
import triton.language as tl

# A partition shorter than this costs more in launch/merge overhead than its parallelism gains.
MIN_PARTITION = 256
MAX_SPLITS = 64
CPU_NUM_SMS = 4  # the interpreter runs programs one by one; few splits keep CPU tests quick


@triton.jit
def _attend_partition(
    q_ptr,  # [B, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # int32 [B, max_blocks]
    seq,
    kv_head,
    start,
    end,
    qk_scale,
    softcap,
    group,
    head_dim,
    block_size,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Attention state (acc [GROUP_PAD, D_PAD], m [GROUP_PAD], l [GROUP_PAD]) of the query
    heads of one KV head over context positions [start, end)."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g  # query head h reads kv head h // group
    q_off = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        tok = paged_token_offsets(table_row, offs_n, n_mask, block_size, stride_cb, stride_cs)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * qk_scale  # [G, BLOCK_N]
        if HAS_SOFTCAP:
            s = soft_cap(s, softcap)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        v = tl.load(v_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _decode_single_kernel(
    out_ptr,  # [B, num_heads, head_dim]
    q_ptr,  # [B, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    seq_lens_ptr,  # int32 [B]
    block_table_ptr,  # int32 [B, max_blocks]
    qk_scale,
    softcap,
    window,
    group,
    head_dim,
    block_size,
    stride_ob,
    stride_oh,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (B, num_kv_heads)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start = tl.maximum(seq_len - window, 0)
    acc, m_i, l_i = _attend_partition(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, window_start, seq_len,
        qk_scale, softcap, group, head_dim, block_size, stride_qb, stride_qh, stride_cb,
        stride_cs, stride_ch, stride_bt, GROUP_PAD, D_PAD, BLOCK_N, DOT_PRECISION, HAS_SOFTCAP,
    )  # fmt: skip
    # An empty context (padding rows) has l == 0: write zeros rather than NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * group + offs_g
    o_off = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    o_mask = (offs_g < group)[:, None] & (offs_d < head_dim)[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_split_kernel(
    partial_ptr,  # float32 [B, num_heads, num_splits, head_dim]
    lse_ptr,  # float32 [B, num_heads, num_splits]
    q_ptr,  # [B, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    seq_lens_ptr,  # int32 [B]
    block_table_ptr,  # int32 [B, max_blocks]
    qk_scale,
    softcap,
    window,
    group,
    head_dim,
    block_size,
    partition_size,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (B, num_kv_heads, num_splits); partition p covers [lo + p * size, lo + (p + 1) * size)
    # of the span [lo, seq_len) the query sees (lo = 0 without a window).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.maximum(seq_len - window, 0) + split * partition_size
    if start >= seq_len:
        return  # a shorter span of the batch: the merge kernel skips this partition
    end = tl.minimum(start + partition_size, seq_len)
    acc, m_i, l_i = _attend_partition(
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq, kv_head, start, end, qk_scale,
        softcap, group, head_dim, block_size, stride_qb, stride_qh, stride_cb, stride_cs,
        stride_ch, stride_bt, GROUP_PAD, D_PAD, BLOCK_N, DOT_PRECISION, HAS_SOFTCAP,
    )  # fmt: skip
    # A non-empty partition has l >= 1 (its max term contributes exp2(0)).
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < group
    heads = kv_head * group + offs_g
    seq64 = seq.to(tl.int64)
    p_off = seq64 * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
    p_mask = g_mask[:, None] & (offs_d < head_dim)[None, :]
    tl.store(partial_ptr + p_off, acc / l_i[:, None], mask=p_mask)
    l_off = seq64 * stride_lb + heads * stride_lh + split
    tl.store(lse_ptr + l_off, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [B, num_heads, head_dim]
    partial_ptr,  # float32 [B, num_heads, num_splits, head_dim]
    lse_ptr,  # float32 [B, num_heads, num_splits], base 2
    seq_lens_ptr,  # int32 [B]
    window,
    head_dim,
    partition_size,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    SPLITS_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    # grid: (B, num_heads). out = sum_i w_i o_i / sum_i w_i with w_i = exp2(lse_i - max lse):
    # the largest weight is exactly 1, so nothing overflows however long the context.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    span = seq_len - tl.maximum(seq_len - window, 0)
    num_parts = tl.cdiv(span, partition_size)  # partitions past the end were never written
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_parts
    d_mask = offs_d < head_dim
    seq64 = seq.to(tl.int64)
    lse = tl.load(
        lse_ptr + seq64 * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context: all weights 0
    w = tl.exp2(lse - lse_max)  # [SPLITS_PAD]
    p_off = seq64 * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    parts = tl.load(partial_ptr + p_off, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_off = seq64 * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """How many partitions per context: 1 while batch * num_kv_heads programs already cover the
    SMs; otherwise enough partitions for about two programs per SM, none shorter than
    MIN_PARTITION tokens."""
    programs = batch * num_kv_heads
    if programs >= num_sms or max_seqlen_k < 2 * MIN_PARTITION:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, max_seqlen_k // MIN_PARTITION, MAX_SPLITS))


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def default_tile_n(head_dim: int, dtype: torch.dtype) -> int:
    # 64 tokens x 128 dims of fp16 is a 16 KiB K tile (+16 KiB V): enough bytes in flight per
    # program without spilling registers; float32 and head_dim > 128 halve it.
    return 64 if padded_dim(head_dim) <= 128 and dtype != torch.float32 else 32


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cache_seqlens: torch.Tensor,  # int32 [B]: context length, including the query token
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    softmax_scale: float | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int = 0,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim]
    tile_n: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Decode attention through block tables (cf. flash_attn_with_kvcache with block_table).

    sliding_window W: the query sees its last W positions only (keys k > seq_len - 1 - W, HF's
    semantics), and only their blocks are read. logit_softcap c: scores s * scale become
    c * tanh(s * scale / c) before the softmax.

    num_splits: 0 picks by shape (choose_num_splits), 1 forces the single-pass kernel, > 1 forces
    the split-KV kernel with that many partitions (fewer if the context is short).
    max_seqlen_k: a host-side upper bound on cache_seqlens used to size the partitions; default
    block_table.shape[1] * block_size, which needs no device sync.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    assert q.dim() == 3 and q.shape[2] == head_dim, f"q must be [B, H, {head_dim}]"
    batch, num_heads, _ = q.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert q.dtype == k_cache.dtype, f"q {q.dtype} vs cache {k_cache.dtype}"
    assert q.stride(-1) == 1 and q.device == k_cache.device
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,)
    assert cache_seqlens.is_contiguous() and cache_seqlens.device == q.device
    check_block_table(block_table, batch, q.device)
    check_runnable(_decode_single_kernel, q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    if max_seqlen_k is None:
        max_seqlen_k = block_table.shape[1] * block_size
    window = kernel_window(sliding_window)
    # The partitions divide the span a query reads, at most the window.
    max_seqlen_k = max(min(max_seqlen_k, window), 1)
    tile = tile_n or default_tile_n(head_dim, q.dtype)
    assert tile >= 16 and tile == next_pow2(tile), f"tile_n must be a power of two >= 16: {tile}"
    if num_splits == 0:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seqlen_k, device_num_sms(q.device))
    # Partitions are whole tiles; recount the splits after rounding their size up.
    partition = triton.cdiv(triton.cdiv(max_seqlen_k, max(num_splits, 1)), tile) * tile
    num_splits = triton.cdiv(max_seqlen_k, partition)

    common = dict(
        qk_scale=scale * LOG2E,
        softcap=kernel_softcap(logit_softcap),
        window=window,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
    )
    strides = dict(
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_cb=k_cache.stride(0),
        stride_cs=k_cache.stride(1),
        stride_ch=k_cache.stride(2),
        stride_bt=block_table.stride(0),
    )
    consts = dict(
        GROUP_PAD=padded_dim(group),
        D_PAD=padded_dim(head_dim),
        BLOCK_N=tile,
        DOT_PRECISION=dot_precision(q.dtype),
        HAS_SOFTCAP=logit_softcap is not None,
        num_warps=4,
    )
    if num_splits == 1:
        _decode_single_kernel[(batch, num_kv_heads)](
            out, q, k_cache, v_cache, cache_seqlens, block_table, **common,
            stride_ob=out.stride(0), stride_oh=out.stride(1), **strides, **consts,
        )  # fmt: skip
        return out

    partial = torch.empty(
        (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        partial, lse, q, k_cache, v_cache, cache_seqlens, block_table, **common,
        partition_size=partition, stride_pb=partial.stride(0), stride_ph=partial.stride(1),
        stride_ps=partial.stride(2), stride_lb=lse.stride(0), stride_lh=lse.stride(1),
        **strides, **consts,
    )  # fmt: skip
    _merge_splits_kernel[(batch, num_heads)](
        out, partial, lse, cache_seqlens, window, head_dim, partition,
        out.stride(0), out.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1),
        SPLITS_PAD=next_pow2(num_splits), D_PAD=padded_dim(head_dim), num_warps=4,
    )  # fmt: skip
    return out
