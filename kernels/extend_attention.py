"""Extend (prefill) attention over paged K/V: the new tokens of many sequences, flattened varlen
(cu_seqlens_q), attend to their cached prefix and causally to each other.

The new tokens' K/V are already in the pool (the backend writes them first), so prefill, prefill
over a prefix-cache hit, a chunk of a long prompt and mixed decode rows are one case: sequence b's
q rows are the last q_len positions of a context of seqused_k[b] tokens, all read through its
block table. One program owns BLOCK_M consecutive q rows of one sequence and one query head and
streams K/V tiles up to its last row's position; only keys past a row's own position are masked.

A sliding window W lets the row at position p see keys p - W < k <= p only (HF's semantics): a
program walks K/V from the tile holding its first row's window start and never reads a key
before that start, and masks the keys that fall out of each row's window. A logit soft-cap c
turns each score s into c * tanh(s / c) before the mask.

A row's result is the same bits wherever its q tile starts (a prefill in one piece, in chunks,
after a prefix-cache hit, or a decode row): K/V tiles start at multiples of BLOCK_N from
position 0, the keys outside a row's window add exact zeros, and common.dot computes each row
the same way wherever it sits in the tile. So in batch-invariant mode the backend sends every
row here (triton_backend.py).
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


@triton.jit
def _extend_kernel(
    out_ptr,  # [total_q, num_heads, head_dim]
    q_ptr,  # [total_q, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]: context length including the new tokens
    block_table_ptr,  # int32 [B, max_blocks]
    qk_scale,
    softcap,  # base-2 units (common.kernel_softcap); read when HAS_SOFTCAP
    window,  # common.kernel_window: NO_WINDOW when the layer has none
    group,
    head_dim,
    block_size,
    stride_ot,
    stride_oh,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (cdiv(max_seqlen_q, BLOCK_M), B, num_heads)
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= q_len:
        return  # this sequence has fewer q rows than the longest one
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before the first q row

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row index within the sequence
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)
    q_off = rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m  # [BLOCK_M] context position of each row

    # Causal: keys up to the last row's position, the tile's own triangle and nothing after it.
    kv_end = tl.minimum(seq_len, prefix + (q_tile + 1) * BLOCK_M) if CAUSAL else seq_len
    # Window: no key before the first row's window start is read (the launcher refuses
    # non-causal). The walk's tiles still start at multiples of BLOCK_N from position 0, so a
    # row adds its keys in the same tiles wherever its chunk began: a row's sums do not depend
    # on how its prompt was split (batch_invariant). The keys of the first tile that fall
    # before kv_lo are masked: not loaded, and outside every row's window.
    kv_lo = tl.maximum(prefix + q_tile * BLOCK_M - window + 1, 0)
    kv_start = kv_lo // BLOCK_N * BLOCK_N
    kv_head = head // group
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < kv_end) & (offs_n >= kv_lo)
        tok = paged_token_offsets(table_row, offs_n, n_mask, block_size, stride_cb, stride_cs)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = soft_cap(s, softcap)
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= q_pos[:, None])
            valid = valid & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        v = tl.load(v_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    # Padding rows (past q_len) may have seen no key (l == 0); they are not stored anyway.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    o_mask = m_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


def default_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    # (BLOCK_M, BLOCK_N): 64x64 fp16 tiles of up to 128 dims keep q, k, v and the fp32
    # accumulator in registers at 4 warps; float32 or wider heads halve both.
    if padded_dim(head_dim) <= 128 and dtype != torch.float32:
        return 64, 64
    return 32, 32


def extend_attention(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    seqused_k: torch.Tensor,  # int32 [B]: context length, the q rows being its last positions
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    max_seqlen_q: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    out: torch.Tensor | None = None,  # [total_q, num_heads, head_dim]
    block_m: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    """Varlen attention over paged K/V (cf. flash_attn_varlen_func with seqused_k and
    block_table). max_seqlen_q (host int, >= every q_len) sizes the grid without a sync.

    sliding_window W (causal only): the row at position p sees keys p - W < k <= p, its last W
    positions (HF's semantics); blocks wholly before a program's first window are not read.
    logit_softcap c: scores s * scale become c * tanh(s * scale / c) before the mask."""
    assert sliding_window is None or causal, "a sliding window needs causal attention"
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    assert q.dim() == 3 and q.shape[2] == head_dim, f"q must be [T, H, {head_dim}]"
    total_q, num_heads, _ = q.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert q.dtype == k_cache.dtype, f"q {q.dtype} vs cache {k_cache.dtype}"
    assert q.stride(-1) == 1 and q.device == k_cache.device
    batch = seqused_k.shape[0]
    assert seqused_k.dtype == torch.int32 and seqused_k.is_contiguous() and seqused_k.dim() == 1
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,)
    assert cu_seqlens_q.is_contiguous()
    assert seqused_k.device == cu_seqlens_q.device == q.device
    check_block_table(block_table, batch, q.device)
    check_runnable(_extend_kernel, q.device)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0 or total_q == 0 or max_seqlen_q == 0:
        return out

    default_m, default_n = default_tiles(head_dim, q.dtype)
    tile_m, tile_n = block_m or default_m, block_n or default_n
    for tile in (tile_m, tile_n):
        assert tile >= 16 and tile == next_pow2(tile), f"tiles must be powers of two >= 16: {tile}"
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    grid = (triton.cdiv(max_seqlen_q, tile_m), batch, num_heads)
    _extend_kernel[grid](
        out, q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table,
        scale * LOG2E, kernel_softcap(logit_softcap), kernel_window(sliding_window),
        num_heads // num_kv_heads, head_dim, block_size,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        CAUSAL=causal, BLOCK_M=tile_m, BLOCK_N=tile_n, D_PAD=padded_dim(head_dim),
        DOT_PRECISION=dot_precision(q.dtype), HAS_SOFTCAP=logit_softcap is not None,
        num_warps=4,
    )  # fmt: skip
    return out
