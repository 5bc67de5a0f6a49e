"""The one-program-per-row RMSNorm: against LayerOps' torch code (float64 statistics for the
bound), the residual add's exact sum, per-head views, and a row the same bits in any batch."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.rms_norm import rms_norm
from batchpage.kernels.testing import interpreter_skip_reason
from batchpage.ops.layer_ops import LayerOps

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 on a GPU only: Triton's interpreter has no bfloat16 arithmetic (numpy has no such
# type) and gives garbage for it.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-6


def _ulps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _rows(t: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 3).to(dtype).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE)
    return x, w


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Within two roundings of the dtype (the statistic's last bits may differ from torch's)."""
    err = ((got.double() - ref.double()).abs() / ref.double().abs().clamp(min=1e-3)).max().item()
    assert err <= 2.5 * _ulps(dtype), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 100, 576])
def test_against_the_torch_layer_ops(dtype, d) -> None:
    x, w = _rows(17, d, dtype)
    out, ref = torch.empty_like(x), torch.empty_like(x)
    rms_norm(out, x, w, EPS)
    LayerOps().rms_norm(ref, x, w, EPS)
    _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_residual_add_then_norm(dtype) -> None:
    """residual += x in the residual's dtype (the same bits as torch's add_), then its norm."""
    x, w = _rows(9, 128, dtype, seed=1)
    residual, _ = _rows(9, 128, dtype, seed=2)
    res_ref = residual.clone()
    out, ref = torch.empty_like(x), torch.empty_like(x)
    rms_norm(out, x, w, EPS, residual=residual)
    LayerOps().add_rms_norm(ref, res_ref, x, w, EPS)
    assert torch.equal(residual, res_ref)
    _close(out, ref, dtype)


def test_per_head_views_of_a_fused_projection() -> None:
    """Qwen3's q/k norms: [T, H, D] views of a wider [T, width] output, head by head."""
    g = torch.Generator().manual_seed(0)  # as _rows: the same inputs whatever ran before
    qkv = torch.randn(5, 6 * 32, generator=g).to(DEVICE)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = (torch.rand(32, generator=g) + 0.5).to(DEVICE)
    out, ref = torch.empty_like(q), torch.empty_like(q)
    rms_norm(out, q, w, EPS)
    LayerOps().rms_norm(ref, q, w, EPS)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_in_any_batch(dtype) -> None:
    x, w = _rows(64, 576, dtype, seed=3)
    whole = torch.empty_like(x)
    rms_norm(whole, x, w, EPS)
    for lo, hi in [(0, 1), (13, 14), (5, 40)]:
        part = torch.empty_like(x[lo:hi])
        rms_norm(part, x[lo:hi], w, EPS)
        assert torch.equal(part, whole[lo:hi])


def test_launcher_checks() -> None:
    x, w = _rows(3, 64, torch.float32)
    with pytest.raises(AssertionError):
        rms_norm(torch.empty_like(x), x, w.to(torch.bfloat16), EPS)  # weight of another dtype
    with pytest.raises(AssertionError):
        rms_norm(torch.empty(3, 32), x, w, EPS)  # output of another shape
    with pytest.raises(AssertionError):
        rms_norm(torch.empty_like(x.t()), x.t(), w[:3], EPS)  # D not contiguous
