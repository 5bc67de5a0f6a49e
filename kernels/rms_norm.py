"""RMSNorm (and the residual add before it) with one program per row: a row's statistic is one
fixed reduction over its own D values, whatever the number of rows.

torch's reductions on a GPU split a row across more threads, or across several blocks, when
there are too few rows to fill the device, so a row's mean of squares can change with its batch;
here it cannot (what EngineConfig.batch_invariant needs of a GPU's norms). The values are
LayerOps.rms_norm's: statistics in float32, the normalised row rounded to the input's dtype, then
multiplied by the weight in that dtype.
"""

from __future__ import annotations

import torch

# common first: it turns Triton's interpreter on where there is no CUDA, before triton loads.
from batchpage.kernels.common import check_runnable, next_pow2

# isort: split
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H, D]
    res_ptr,  # [T, H, D]: the residual stream (ADD: += x first, in its dtype), else unused
    x_ptr,  # [T, H, D]
    w_ptr,  # [D]
    D,
    eps,
    stride_ot,
    stride_oh,
    stride_rt,
    stride_rh,
    stride_xt,
    stride_xh,
    ADD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T, H); one program normalises one row of D values.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if ADD:
        r_ptrs = res_ptr + t * stride_rt + h * stride_rh + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / D
    # IEEE-rounded sqrt and division (tl.sqrt is an approximation on a GPU).
    normed = (xf * tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    o_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """The (token, head) strides of a [T, D] or [T, H, D] tensor (0 for a missing head axis)."""
    assert t.dim() in (2, 3) and t.stride(-1) == 1, f"[T, (H,) D] with unit D stride: {t.shape}"
    return (t.stride(0), 0) if t.dim() == 2 else (t.stride(0), t.stride(1))


def rms_norm(
    out: torch.Tensor,  # [T, D] or [T, H, D], x's dtype
    x: torch.Tensor,  # [T, D] or [T, H, D], unit stride along D
    weight: torch.Tensor,  # [D], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape: += x first, then it is normalised
) -> None:
    """out = weight * T(r * rsqrt(mean(r^2) + eps)), r = x, or residual after residual += x;
    T the rounding to x's dtype. `out` aliases neither x nor residual."""
    assert x.dtype in DTYPES and out.dtype == weight.dtype == x.dtype, (x.dtype, weight.dtype)
    assert out.shape == x.shape and weight.shape == (x.shape[-1],) and weight.is_contiguous()
    assert out.device == x.device == weight.device
    source = x if residual is None else residual
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.device == x.device
    check_runnable(_rms_norm_kernel, x.device)
    heads = 1 if x.dim() == 2 else x.shape[1]
    if x.shape[0] == 0 or heads == 0:
        return
    _rms_norm_kernel[(x.shape[0], heads)](
        out, source, x, weight, x.shape[-1], eps, *_rows(out), *_rows(source), *_rows(x),
        ADD=residual is not None, BLOCK_D=next_pow2(x.shape[-1]), num_warps=4,
    )  # fmt: skip
