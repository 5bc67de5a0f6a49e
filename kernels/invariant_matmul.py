"""A batch-invariant matmul: y = x @ W.T + b with tiles fixed by the dtype, never by the rows.

cuBLAS picks its algorithm (split-K, tile shape, stream-K) from M, N and K, so a row's output can
change with how many other rows share its call. Here every output element is one sum over K in
BLOCK_K steps, in order, accumulated in float32 by tl.dot on tiles whose shapes depend only on
the dtype: the same instructions add the same products in the same order whether the row is
alone or one of thousands (what EngineConfig.batch_invariant needs of a GPU's linears; cf.
"Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025). The price is a tile that
a small batch cannot fill.
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import check_runnable, dot, dot_precision

# isort: split
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _matmul_kernel(
    y_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy when not HAS_BIAS
    M,
    N,
    K,
    stride_ym,
    stride_xm,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); one program owns one output tile and sums all
    # of K itself (no split-K), tile after tile from k = 0.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += dot(x, tl.trans(w), DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_off = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a dtype, the one thing they depend on: 16-bit tiles of
    64 x 64 x 64 keep a 4-warp program's operands and float32 accumulator in registers; float32
    operands are twice the bytes, so K is halved."""
    if dtype == torch.float32:
        return 32, 64, 32
    return 64, 64, 64


def invariant_matmul(
    x: torch.Tensor,  # [M, K], rows dense
    weight: torch.Tensor,  # [N, K], contiguous
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N], contiguous
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ weight.T + bias, each output one fixed-order float32 sum over K, rounded once."""
    assert x.dim() == 2 and weight.dim() == 2, (tuple(x.shape), tuple(weight.shape))
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)} for x {tuple(x.shape)}"
    assert x.dtype in DTYPES and weight.dtype == x.dtype, (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.is_contiguous(), "rows of x and weight must be dense"
    assert weight.device == x.device
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous() and bias.device == x.device
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.is_contiguous()
    check_runnable(_matmul_kernel, x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = tiles(x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](
        out, x, weight, bias if bias is not None else out, m, n, k,
        out.stride(0), x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=4,
    )  # fmt: skip
    return out
