"""The bf16 linear kernel (kernels/cpu_bf16_linear.cpp) against a float64 torch reference: the
packed layout element by element, every row, column and k tail, a bias, strided and batched
inputs, and an odd K that must not read past a row. Both builds run on every CPU: the portable
float32 loop (the portable build) and, where the CPU has AVX512-BF16, the vdpbf16ps one."""

from __future__ import annotations

import pytest
import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_bf16_linear import (
    SOURCE,
    CpuBf16Linear,
    pack_gated_weight,
    pack_weight,
)
from batchpage.kernels.cpu_build import build_extension

NATIVE = "avx512_bf16" in cpu_flags()


def portable_kernel() -> CpuBf16Linear:
    """The build without AVX512-BF16 (a portable CPU's), on any CPU."""
    module = build_extension(SOURCE, "batchpage_cpu_bf16_linear", "the bf16 linear", isa="portable")
    built = CpuBf16Linear(module)
    assert not built.native
    return built


def best_kernel() -> CpuBf16Linear:
    """The engine's build where this CPU has AVX512-BF16, else the portable one."""
    if not NATIVE:
        return portable_kernel()
    built = CpuBf16Linear.build()
    assert built.native
    return built


@pytest.fixture(scope="module", params=["portable", "native"])
def kernel(request) -> CpuBf16Linear:
    if request.param == "portable":
        return portable_kernel()
    if not NATIVE:
        pytest.skip("this CPU has no AVX512-BF16")
    return best_kernel()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 inputs plus the float32 bias, rounded once to bf16."""
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    return y.to(torch.bfloat16)


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    # Both are bf16 roundings of sums that differ only by float32 accumulation (~K * 2^-24 of
    # the terms' size): at most one bf16 step apart, 2^-8 of the value.
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-8, atol=1e-4)


def test_pack_layout_element_by_element():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 7, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    assert packed.shape == (2, 4, 32) and packed.dtype == torch.int32
    bits = w.view(torch.int16).int() & 0xFFFF
    for j in range(2):
        for p in range(4):
            for c in range(32):
                row, lo, hi = 32 * j + c, 2 * p, 2 * p + 1
                want_lo = int(bits[row, lo]) if row < 37 else 0
                want_hi = int(bits[row, hi]) if row < 37 and hi < 7 else 0
                got = int(packed[j, p, c]) & 0xFFFFFFFF
                assert (got & 0xFFFF, got >> 16) == (want_lo, want_hi), (j, p, c)


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 64, 71])
@pytest.mark.parametrize(("n", "k"), [(32, 64), (96, 48), (20, 40), (8, 16), (100, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(kernel, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    got = kernel.linear(x, pack_weight(w), b, n)
    assert_matches(got, reference(x, w, b))


def test_odd_k_reads_nothing_past_a_row(kernel):
    """K = 33 with rows 34 apart whose 34th element is Inf: a kernel reading a pair across the
    row's end would make NaN (0 * Inf) or Inf."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 33, generator=g).to(torch.bfloat16)
    storage = torch.randn(19, 34, generator=g).to(torch.bfloat16)
    storage[:, 33] = float("inf")
    x = storage[:, :33]
    got = kernel.linear(x, pack_weight(w), None, 40)
    assert torch.isfinite(got.float()).all()
    assert_matches(got, reference(x, w, None))


def test_batched_and_strided_inputs(kernel):
    """Leading batch dimensions, and a column slice whose rows are not dense (copied first)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    packed = pack_weight(w)
    x3 = torch.randn(2, 9, 48, generator=g).to(torch.bfloat16)
    assert kernel.linear(x3, packed, None, 64).shape == (2, 9, 64)
    assert_matches(kernel.linear(x3, packed, None, 64), reference(x3, w, None))
    wide = torch.randn(11, 96, generator=g).to(torch.bfloat16)
    for x in (wide[:, 16:64], wide[:, ::2]):
        assert_matches(kernel.linear(x, packed, None, 64), reference(x, w, None))
    assert kernel.linear(wide[:0, :48], packed, None, 64).shape == (0, 64)


@pytest.mark.parametrize("gated", [False, True])
def test_rows_split_over_threads_where_blocks_are_few(kernel, gated):
    """With more threads than column blocks the rows are split into groups of 8-row tiles too
    (2 blocks at 8 threads: up to 16 groups); every row and column still lands once."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16)  # 2 blocks, or 2 gated of I = 20
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        for rows in (1, 9, 64, 131):
            x = torch.randn(rows, 24, generator=g).to(torch.bfloat16)
            if gated:
                gate, up = reference(x, w, None).split(20, dim=-1)
                got = kernel.silu_mul_linear(x, pack_gated_weight(w), 20).float()
                want = (torch.nn.functional.silu(gate) * up).float()
                torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-3)
            else:
                assert_matches(kernel.linear(x, pack_weight(w), None, 40), reference(x, w, None))
    finally:
        torch.set_num_threads(before)


def test_gated_pack_pairs_gate_and_up_columns():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2 * 20, 6, generator=g).to(torch.bfloat16)  # I = 20: one full block of 16
    gate, up = w[:20], w[20:]
    want = torch.zeros(64, 6, dtype=torch.bfloat16)
    want[0:16], want[16:32] = gate[0:16], up[0:16]
    want[32:36], want[48:52] = gate[16:20], up[16:20]  # the second block: 4 columns, zeros after
    assert torch.equal(pack_gated_weight(w), pack_weight(want))


@pytest.mark.parametrize("rows", [1, 8, 13, 64])
@pytest.mark.parametrize(("inter", "k"), [(16, 32), (20, 48), (96, 33), (40, 64)])
def test_silu_mul_linear_matches_reference(kernel, rows, inter, k):
    """SiLU(gate) * up from the merged weight, rounded as torch rounds F.silu(gate) * up on the
    bf16 gate_up product."""
    g = torch.Generator().manual_seed(rows * 100 + inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * k**-0.5 * 3).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    gate, up = reference(x, w, None).split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernel.silu_mul_linear(x, pack_gated_weight(w), inter)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    # gate and up may each sit a bf16 step from the exact product's rounding; SiLU and the
    # product add a rounding each.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-3)


@pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512-BF16")
def test_silu_mul_linear_equals_linear_then_silu_mul_bit_for_bit():
    """On AVX512-BF16 the fused epilogue gives what the engine's unfused pair gives: the same
    sums (each column's k order is the same), then cpu_layer_ops's silu_mul rounding and exp."""
    from batchpage.kernels.cpu_layer_ops import CpuLayerOps

    kernel, ops = best_kernel(), CpuLayerOps.build()
    g = torch.Generator().manual_seed(4)
    for rows, inter, k in ((64, 1536, 576), (7, 40, 96), (33, 100, 62)):
        w = (torch.randn(2 * inter, k, generator=g) * k**-0.5 * 4).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        unfused = ops.silu_mul(kernel.linear(x, pack_weight(w), None, 2 * inter))
        assert torch.equal(kernel.silu_mul_linear(x, pack_gated_weight(w), inter), unfused)


def test_launcher_rejects_mismatched_shapes(kernel):
    w = torch.randn(64, 48).to(torch.bfloat16)
    packed = pack_weight(w)
    with pytest.raises(AssertionError):
        kernel.linear(torch.randn(3, 50).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(AssertionError):
        kernel.linear(torch.randn(3, 48), packed, None, 64)  # float32 input
    with pytest.raises(AssertionError):
        kernel.linear(torch.randn(3, 48).to(torch.bfloat16), packed, torch.zeros(63), 64)
    with pytest.raises(AssertionError):  # 64 packed columns are 4 gated blocks of 16, not 2
        kernel.silu_mul_linear(torch.randn(3, 48).to(torch.bfloat16), packed, 64)
