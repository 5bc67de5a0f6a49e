"""The int8-activation kernel's int32 sums, exactly, at the corners where AVX2's vpmaddubsw
saturates (kernels/cpu_a8_linear.cpp: 4-bit weights in int16 sums of up to 8 quads, 8-bit ones
through vpmaddwd on int16), against float64 element by element; and its quantization against
batchpage.quant.activations.quantize_rows_int8 bit for bit. Every path runs (AVX2 in this CPU's
build and in the build an AVX2 CPU loads, VNNI, the plain loop); the rows come as int8
(CpuA8Linear.linear_int8: -128 included, which the kernel's own quantization of a finite row
never makes) with unit scales, so that each result is an integer sum below 2^24, exact in
float32: any saturation, dropped k or misplaced column changes it."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.cpu_a8_linear import CpuA8Linear, pack_a8_weight
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight, pack_nibbles
from tests.kernels.test_cpu_a8_linear import BUILDS, IDS, build, rows_with_nan_after


@pytest.fixture(scope="module", params=list(BUILDS), ids=IDS)
def kernel(request) -> CpuA8Linear:
    return build(*request.param)


def unit_weight(q: torch.Tensor, bits: int, group: int, signed: bool) -> IntWeight:
    """q [N, K] with scales 1 and offsets 0 (W = q, unsigned), or -2^(bits-1) (W = q - 2^(bits-1):
    a symmetric int8 or int4 weight as W8A8 / W4A8 checkpoints store it)."""
    n, k = q.shape
    groups = -(-k // group)
    offsets = torch.full((n, groups), -float(1 << (bits - 1)) if signed else 0.0)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, torch.ones(n, groups), offsets, bits, group, k)


def exact(xq: torch.Tensor, w: IntWeight) -> torch.Tensor:
    """float64 [M, N]: sum_k xq[m, k] * W[n, k], integers."""
    return xq.double() @ w.dequantize_stored(torch.float64).T


def corner_rows(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int8 [m, k]: row 0 all -128, row 1 all 127, row 2 alternating -128 / 127, the rest drawn
    from {-128, -127, 127} (the saturating extremes) and, in the last row, from every value."""
    patterns = [
        torch.full((k,), -128),
        torch.full((k,), 127),
        torch.where(torch.arange(k) % 2 == 0, -128, 127),
    ]
    rows = [patterns[r] if r < 3 else torch.tensor([-128, -127, 127])[
        torch.randint(0, 3, (k,), generator=gen)] for r in range(m)]  # fmt: skip
    if m > 3:
        rows[-1] = torch.randint(-128, 128, (k,), generator=gen)
    return torch.stack(rows).to(torch.int8)


def corner_weight(bits: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int [N, K]: column 0 all the largest q, column 1 all 0, column 2 alternating, the rest
    drawn from {0, 1, top - 1, top}."""
    top = (1 << bits) - 1
    q = torch.tensor([0, 1, top - 1, top])[torch.randint(0, 4, (n, k), generator=gen)]
    q[0], q[1] = top, 0
    q[2] = torch.where(torch.arange(k) % 2 == 0, top, 0)
    return q


# K: below a quad, not a multiple of 4, of kind 4's 8-quad int16 chunk (32) or of the 8 and 16
# columns of an AVX2 tile; 514 * 255 * 128 stays below 2^24 (exact float32 results).
KS = [1, 3, 5, 31, 33, 66, 130, 257, 514]


@pytest.mark.parametrize("bits", [4, 7, 8])
@pytest.mark.parametrize("signed", [False, True])
def test_int32_sums_at_the_saturation_corners_equal_float64(kernel, bits, signed):
    gen = torch.Generator().manual_seed(bits * 10 + signed)
    for k in KS:
        for n in (3, 37, 64):  # one octet's part, a partial block, two blocks
            w = unit_weight(corner_weight(bits, n, k, gen), bits, k, signed)
            packed = pack_a8_weight(w)
            for m in (1, 2, 3, 4, 7):  # a row alone, tiles of three and the rows left over
                xq = corner_rows(m, k, gen)
                got = kernel.linear_int8(xq, torch.ones(m), packed, None)
                want = exact(xq, w)
                assert want.abs().max() < 2**24
                assert torch.equal(got.double(), want), (k, n, m, (got.double() - want).abs().max())


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_sums_over_long_rows_equal_float64(kernel, bits):
    """Groups of 32 and 128 over K = 2000 (kind 4: many int16 chunks a group, and groups that
    end inside a chunk of a longer one), every row -128 or 127 against the largest q."""
    gen = torch.Generator().manual_seed(bits)
    k = 2000 if bits == 4 else 500  # |sum| < 2^24
    for group in (32, 128, k):
        q = corner_weight(bits, 40, k, gen)
        w = unit_weight(q, bits, group, signed=True)
        xq = corner_rows(5, k, gen)
        got = kernel.linear_int8(xq, torch.ones(5), pack_a8_weight(w), None)
        assert torch.equal(got.double(), exact(xq, w)), group


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantization_is_quantize_rows_int8s(kernel, bits, dtype):
    """linear(x) is linear_int8 of quantize_rows_int8(x) bit for bit, for rows whose extremes
    quantize to +-127 (a row's max and min of equal size) and random ones, at M = 1 and more."""
    gen = torch.Generator().manual_seed(20 + bits)
    k, n = 70, 45
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    groups = -(-k // 32)
    w = IntWeight(
        pack_nibbles(q) if bits == 4 else q.to(torch.uint8),
        torch.rand(n, groups, generator=gen) * 0.01 + 1e-3,
        torch.randn(n, groups, generator=gen) * 0.1,
        bits,
        32,
        k,
    )
    packed, b = pack_a8_weight(w), torch.randn(n, generator=gen)
    for m in (1, 4, 9):
        x = rows_with_nan_after(m, k, gen).to(dtype)
        x[0, 3], x[0, 9] = 5.0, -5.0
        values, scales = quantize_rows_int8(x)
        assert values[0, 3] == 127 and values[0, 9] == -127
        got = kernel.linear(x, packed, b)
        again = kernel.linear_int8(values.to(torch.int8), scales[:, 0], packed, b, dtype)
        assert torch.equal(got, again)


def test_linear_int8_checks_its_inputs(kernel):
    gen = torch.Generator().manual_seed(3)
    w = unit_weight(corner_weight(8, 8, 12, gen), 8, 12, signed=False)
    packed = pack_a8_weight(w)
    xq = torch.zeros(2, 12, dtype=torch.int8)
    assert kernel.linear_int8(xq, torch.ones(2), packed, None).shape == (2, 8)
    with pytest.raises(AssertionError):
        kernel.linear_int8(xq.to(torch.int16), torch.ones(2), packed, None)
    with pytest.raises(AssertionError):
        kernel.linear_int8(xq, torch.ones(3), packed, None)
    with pytest.raises(AssertionError):
        kernel.linear_int8(
            torch.zeros(2, 24, dtype=torch.int8)[:, ::2], torch.ones(2), packed, None
        )
    with pytest.raises(AssertionError):
        kernel.linear_int8(xq, torch.ones(2), packed, None, torch.float16)
