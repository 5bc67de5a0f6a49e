"""The batch-invariant matmul: x @ W.T + b against float64, and every row the same bits whatever
other rows share its call (alone, in a slice, reordered, among many more)."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.invariant_matmul import invariant_matmul, tiles
from batchpage.kernels.testing import interpreter_skip_reason

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 on a GPU only: Triton's interpreter has no bfloat16 arithmetic (numpy has no such
# type) and gives garbage for it.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# A float32 sum's error over K terms of size ~1 is a few ulps times sqrt(K); the half types are
# rounded once, at the end.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def _reference(x, w, b) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "bias"),
    [(1, 64, 64, False), (5, 70, 100, True), (70, 33, 130, False), (3, 200, 31, True)],
)
def test_against_float64(dtype, m, n, k, bias) -> None:
    """Ragged M, N and K (tiles part-filled on every edge), with and without a bias."""
    x, w, b = _case(m, n, k, dtype, bias)
    got = invariant_matmul(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    ref = _reference(x, w, b)
    err = (got.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_in_any_batch(dtype) -> None:
    """Each row computed among 150 (three row tiles) equals the same row alone, in a slice that
    starts mid-tile, reversed, and inside a batch of other rows: bit for bit."""
    x, w, b = _case(150, 96, 200, dtype, bias=True, seed=1)
    whole = invariant_matmul(x, w, b)
    for row in (0, 37, 149):
        assert torch.equal(invariant_matmul(x[row : row + 1], w, b)[0], whole[row])
    assert torch.equal(invariant_matmul(x[7:80], w, b), whole[7:80])
    assert torch.equal(invariant_matmul(x.flip(0).contiguous(), w, b).flip(0), whole)
    others, _, _ = _case(300, 96, 200, dtype, bias=False, seed=2)
    mixed = torch.cat([others[:100], x[40:41], others[100:]])
    assert torch.equal(invariant_matmul(mixed, w, b)[100], whole[40])


def test_writes_into_out_and_reads_strided_rows() -> None:
    """Rows with a stride (a slice of a wider buffer) and a given output buffer."""
    x, w, b = _case(9, 40, 64, torch.float32, bias=True)
    wide = torch.zeros(9, 100, device=DEVICE)
    wide[:, 10:74] = x
    out = torch.full((9, 40), float("nan"), device=DEVICE)
    got = invariant_matmul(wide[:, 10:74], w, b, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, invariant_matmul(x, w, b))


def test_empty_rows() -> None:
    x, w, _ = _case(0, 8, 16, torch.float32, bias=False)
    assert invariant_matmul(x, w).shape == (0, 8)


def test_tiles_depend_on_the_dtype_only() -> None:
    assert tiles(torch.bfloat16) == tiles(torch.float16)
    assert all(t >= 16 for t in tiles(torch.float32))


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, w: (x.double(), w),  # dtype outside the kernel's
        lambda x, w: (x, w.to(torch.bfloat16)),  # weight of another dtype
        lambda x, w: (x, w[:, :-1]),  # K mismatch
        lambda x, w: (x.t().contiguous().t(), w),  # column-major rows
        lambda x, w: (x, w.t().contiguous().t()),  # a non-contiguous weight
    ],
)
def test_launcher_checks(bad) -> None:
    x, w, _ = _case(4, 16, 16, torch.float32, bias=False)
    with pytest.raises(AssertionError):
        invariant_matmul(*bad(x, w))
