"""The Triton int kernel (a GPU's quantized linears) under the interpreter: x @ W.T against the
float64 reference of IntWeight.dequantize_stored for 4-bit, byte-stored (6, 8 bits) and FP8
codes, groups of 32, 128 and one, ragged tiles, a bias; a row the same bits in any batch; the
launcher's checks."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.int_matmul import int_matmul
from batchpage.kernels.testing import interpreter_skip_reason
from batchpage.quant.int_weight import IntWeight, pack_nibbles

_SKIP = interpreter_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 on a GPU only: Triton's interpreter has no bfloat16 arithmetic.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def random_weight(kind: str, n: int, k: int, group: int, gen: torch.Generator) -> IntWeight:
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * k**-0.5
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN -> 0
        return IntWeight(codes, scales / 64, torch.zeros(n, groups), 8, group, k, None, True)
    bits = int(kind)
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = scales / 2 ** (bits - 2)
    offsets = -scales * torch.randint(0, 2**bits, (n, groups), generator=gen)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, group, k)


def run(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return int_matmul(
        x, w.packed.to(DEVICE), w.scales.to(DEVICE), w.offsets.to(DEVICE), w.storage_bits,
        w.group_size, fp8=w.float8, bias=None if bias is None else bias.to(DEVICE),
    )  # fmt: skip


def reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """W rounded to x's dtype (as the kernel feeds tl.dot), the product in float64."""
    dense = w.dequantize_stored(torch.float32).to(x.dtype).double()
    y = x.double().cpu() @ dense.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["4", "6", "8", "fp8"])
@pytest.mark.parametrize(("n", "k", "group"), [(64, 256, 32), (70, 100, 128), (33, 130, 64)])
def test_against_float64(dtype, kind, n, k, group) -> None:
    gen = torch.Generator().manual_seed(n + k + len(kind))
    w = random_weight(kind, n, k, group, gen)
    bias = torch.randn(n, generator=gen) if n % 2 == 0 else None
    x = torch.randn(5, k, generator=gen).to(dtype).to(DEVICE)
    got = run(x, w, bias)
    assert got.dtype == dtype and got.shape == (5, n)
    ref = reference(x, w, bias)
    err = (got.double().cpu() - ref).abs().max().item()
    assert err <= 4 * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item()), err


def test_a_wrong_group_or_nibble_order_fails_the_reference() -> None:
    """The tolerance above catches the layout mistakes the kernel could make."""
    gen = torch.Generator().manual_seed(5)
    w = random_weight("4", 64, 256, 32, gen)
    x = torch.randn(4, 256, generator=gen).to(DEVICE)
    ref = reference(x, w, None)
    swapped = IntWeight((w.packed >> 4) | (w.packed << 4), w.scales, w.offsets, 4, 32, 256)
    shifted = IntWeight(w.packed, w.scales.roll(1, 1), w.offsets.roll(1, 1), 4, 32, 256)
    for wrong in (swapped, shifted):
        assert (run(x, wrong).double().cpu() - ref).abs().max() > 0.1


@pytest.mark.parametrize("kind", ["4", "fp8"])
def test_a_row_is_the_same_bits_in_any_batch(kind) -> None:
    gen = torch.Generator().manual_seed(9)
    w = random_weight(kind, 96, 200, 64, gen)
    x = torch.randn(70, 200, generator=gen).to(DEVICE)
    whole = run(x, w)
    for lo, hi in [(0, 1), (33, 34), (5, 69)]:
        assert torch.equal(run(x[lo:hi], w), whole[lo:hi])


def test_launcher_checks() -> None:
    gen = torch.Generator().manual_seed(1)
    w = random_weight("4", 32, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    with pytest.raises(AssertionError):  # 8-bit storage claimed for nibbles
        int_matmul(x, w.packed, w.scales, w.offsets, 8, 32)
    with pytest.raises(AssertionError):  # FP8 codes are bytes
        int_matmul(x, w.packed, w.scales, w.offsets, 4, 32, fp8=True)
    with pytest.raises(AssertionError):  # scales of another group size
        int_matmul(x, w.packed, w.scales, w.offsets, 4, 16)
