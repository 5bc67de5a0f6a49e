"""A quantized weight's matmul on a GPU: y = x @ W.T + b with W an IntWeight as stored (W4A16,
W8A16 with group-wise scales and offsets: the AWQ, GPTQ, compressed-tensors and GGUF layouts
after their one repack at load; FP8 e4m3 codes with block scales), unpacked in registers.

The weight stays in IntWeight's own layout ([N, K / 2] bytes at 4 bits, k even in the low
nibble; [N, K] bytes at 8 bits and for FP8), so a decode step reads a half or a quarter of a
bf16 weight's bytes. Each program owns one output tile and walks K in BLOCK_K steps from k = 0:
it loads the tile's codes, turns them into W = s * q + o (q an integer, or an FP8 code's value:
its bits placed in a float32 give fp8 * 2^-120, times 2^120 exact) with the scale and offset of
each element's group, rounds W to x's dtype, and adds tl.dot of the tile into a float32
accumulator. Tiles depend on the dtype only, so like invariant_matmul.py a row's result does not
depend on the other rows (a batch-invariant engine may keep its weights quantized).
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import check_runnable, dot, dot_precision
from batchpage.kernels.invariant_matmul import DTYPES, tiles

# isort: split
import triton
import triton.language as tl

FP8_REBIAS = 2.0**120  # float32 bits (s, e4m3's exponent and mantissa) read as fp8 * 2^-120


@triton.jit
def _int_matmul_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    q_ptr,  # uint8 [N, K / 2] (BITS 4) or [N, K]
    s_ptr,  # float32 [N, G]
    o_ptr,  # float32 [N, G]
    b_ptr,  # [N] float32, or a dummy when not HAS_BIAS
    M,
    N,
    K,
    group_size,
    stride_ym,
    stride_xm,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    n64 = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wk_mask = k_mask[:, None] & n_mask[None, :]  # [BLOCK_K, BLOCK_N], W transposed
        if BITS == 4:
            byte = tl.load(
                q_ptr + n64[None, :] * stride_qn + (k // 2)[:, None], mask=wk_mask, other=0
            )
            code = (byte >> ((k % 2) * 4)[:, None].to(tl.uint8)) & 0xF
        else:
            code = tl.load(q_ptr + n64[None, :] * stride_qn + k[:, None], mask=wk_mask, other=0)
        if FP8:
            c = code.to(tl.uint32)
            bits = ((c & 0x80) << 24) | ((c & 0x7F) << 20)
            value = bits.to(tl.float32, bitcast=True) * FP8_REBIAS
        else:
            value = code.to(tl.float32)
        g_off = n64[None, :] * stride_sn + (k // group_size)[:, None]
        s = tl.load(s_ptr + g_off, mask=wk_mask, other=0.0)
        o = tl.load(o_ptr + g_off, mask=wk_mask, other=0.0)
        w = (s * value + o).to(x.dtype)
        acc += dot(x, w, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int_matmul(
    x: torch.Tensor,  # [M, K], rows dense
    codes: torch.Tensor,  # uint8 [N, ceil(K / 2)] (bits 4) or [N, K]
    scales: torch.Tensor,  # float32 [N, G], contiguous
    offsets: torch.Tensor,  # float32 [N, G], contiguous
    bits: int,  # the storage: 4 (two codes a byte, k even low) or 8 (a byte each)
    group_size: int,
    fp8: bool = False,  # codes are FP8 e4m3 (bits 8), not unsigned integers
    bias: torch.Tensor | None = None,  # float32 [N]
    out: torch.Tensor | None = None,  # [M, N], x's dtype, contiguous
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ (scales * q + offsets).T + bias, per group of `group_size` inputs (IntWeight's
    values, in its stored column order: act order is the caller's)."""
    assert x.dim() == 2 and x.dtype in DTYPES and x.stride(1) == 1, (x.dtype, x.shape)
    m, k = x.shape
    n = codes.shape[0]
    assert bits in (4, 8) and not (fp8 and bits != 8), (bits, fp8)
    width = -(-k // 2) if bits == 4 else k
    assert codes.dtype == torch.uint8 and codes.shape == (n, width), (codes.dtype, codes.shape)
    assert codes.stride(1) == 1
    groups = -(-k // group_size)
    for t in (scales, offsets):
        assert t.dtype == torch.float32 and t.shape == (n, groups) and t.is_contiguous(), t.shape
    assert codes.device == scales.device == offsets.device == x.device
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape == (n,) and bias.is_contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.is_contiguous()
    check_runnable(_int_matmul_kernel, x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = tiles(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_matmul_kernel[grid](
        out, x, codes, scales, offsets, bias if bias is not None else scales, m, n, k,
        group_size, out.stride(0), x.stride(0), codes.stride(0), scales.stride(0),
        BITS=bits, FP8=fp8, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION=dot_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return out
