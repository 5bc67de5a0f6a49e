"""The float32 linear kernel (kernels/cpu_f32_linear.cpp) against a float64 torch reference,
with the bound its fixed summation order gives; rows that are the same bits in any batch (alone,
at every tile remainder, among other rows, over more threads than blocks); and every build the
CPU can run (the AVX-512, AVX2 and portable levels' builds: the plain loop) giving the same bits,
which is the kernel's contract: one fused multiply-add per k, in k order, from zero."""

from __future__ import annotations

import pytest
import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_build import build_extension
from batchpage.kernels.cpu_f32_linear import COLUMNS, SOURCE, CpuF32Linear, pack_weight
from tests.kernels.test_cpu_int_linear import assert_rows_independent

FLAGS = cpu_flags()
BUILDS = {  # path -> (the instruction-set level built for, the CPU flag it needs)
    "avx512": ("avx512", "avx512f"),
    "avx2": ("avx2", "avx2"),
    "plain": ("portable", None),
}


def build(path: str) -> CpuF32Linear:
    level, needs = BUILDS[path]
    if needs is not None and needs not in FLAGS:
        pytest.skip(f"this CPU has no {needs}")
    module = build_extension(SOURCE, "batchpage_cpu_f32_linear", "the float32 linear", isa=level)
    return CpuF32Linear(module)


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request) -> CpuF32Linear:
    return build(request.param)


def reference_and_bound(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product (float64) and how far a K-term float32 sum of fused multiply-adds may
    be from it: each of the K roundings (and the bias's) is off by at most 2^-24 of a partial
    sum, bounded by sum_k |x_k w_k| (+ |b|)."""
    y = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    if bias is not None:
        y, bound = y + bias.double(), bound + bias.double().abs()
    return y, bound * (w.shape[1] + 1) * 2.0**-24


@pytest.mark.parametrize("n,k", [(1, 1), (31, 7), (32, 256), (33, 257), (96, 600), (70, 513)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_within_its_rounding(kernel, n, k, with_bias) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(13, k, generator=gen)
    got = kernel.linear(x, pack_weight(w), bias, n)
    y, bound = reference_and_bound(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (13, n)
    assert ((got.double() - y).abs() <= bound).all()


def test_rows_are_the_same_bits_in_any_batch(kernel) -> None:
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(96, 700, generator=gen), torch.randn(96, generator=gen)
    packed = pack_weight(w)
    x = torch.randn(64, 700, generator=gen)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return kernel.linear(rows, packed, bias, 96)

    assert_rows_independent(run, x, run(x))
    shuffled = torch.randperm(64, generator=gen)
    assert torch.equal(run(x[shuffled]), run(x)[shuffled])


def test_every_build_gives_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(2)
    w, bias = torch.randn(70, 513, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(11, 513, generator=gen)
    runnable = [p for p, (_, needs) in BUILDS.items() if needs is None or needs in FLAGS]
    outs = [build(p).linear(x, pack_weight(w), bias, 70) for p in runnable]
    assert len(outs) >= 2
    for other in outs[1:]:
        assert torch.equal(other, outs[0])


def test_layout_and_strided_inputs(kernel) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(40, 9, generator=gen)
    packed = pack_weight(w)
    assert packed.shape == (2, 9, COLUMNS)
    assert torch.equal(packed[1, 4, :8], w[32:, 4]) and not packed[1, :, 8:].any()
    wide = torch.randn(2, 5, 20, generator=gen)
    x = wide[..., 3:12]  # rows 20 apart
    got = kernel.linear(x, packed, None, 40)
    assert got.shape == (2, 5, 40)
    assert torch.equal(got, kernel.linear(x.contiguous(), packed, None, 40))
    assert kernel.linear(torch.empty(0, 9), packed, None, 40).shape == (0, 40)
    with pytest.raises(AssertionError):
        kernel.linear(x.contiguous(), packed[:1].contiguous(), None, 40)
