"""The int8-activation linear kernel (kernels/cpu_a8_linear.cpp) against a float64 torch
reference: x quantized by batchpage.quant.activations.quantize_rows_int8 (the kernel must
quantize each row exactly so), times IntWeight.dequantize_stored in float64, times the rows'
scales. The layout element by element, 4-, 6- and 8-bit weights, groups of 32, 128 and one,
every k, column and row tail, a bias, NaN after each row's end, bf16 and float32 rows, results
that do not depend on M, and corrupted layouts that must fail. Every path runs on every CPU that
can: AVX512-VNNI and AVX2 in this CPU's build, AVX2 in the build an AVX2 CPU loads, and the plain
loop of the portable build, over the same layout and with the same results bit for bit. The AVX2
path's int32 sums at the saturation corners: test_cpu_a8_avx2.py."""

from __future__ import annotations

import pytest
import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_a8_linear import (
    SOURCE,
    A8Packed,
    CpuA8Linear,
    a8_layout,
    pack_a8_weight,
)
from batchpage.kernels.cpu_build import build_extension
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from tests.kernels.test_cpu_int_linear import (
    assert_rows_independent,
    random_weight,
    rows_with_nan_after,
)

FLAGS = cpu_flags()
# (the instruction-set level built for, None: this CPU's; the path run) -> the flag it needs
BUILDS = {
    (None, "avx512_vnni"): "avx512_vnni",
    (None, "avx2"): "avx2",  # the candidate beside VNNI's on this CPU
    ("avx2", "avx2"): "avx2",  # the build an AVX2 CPU loads
    ("portable", "plain"): None,
}
IDS = [f"{level or 'native'}-{path}" for level, path in BUILDS]


def build(level: str | None, path: str) -> CpuA8Linear:
    needs = BUILDS[level, path]
    if needs is not None and needs not in FLAGS:
        pytest.skip(f"this CPU has no {needs}")
    if level is None:
        module = CpuA8Linear.build().raw
    else:
        module = build_extension(
            SOURCE, "batchpage_cpu_a8_linear", "the int8-activation linear", isa=level
        )
    built = CpuA8Linear(module, path)
    assert built.path == path
    return built


@pytest.fixture(scope="module", params=list(BUILDS), ids=IDS)
def kernel(request) -> CpuA8Linear:
    return build(*request.param)


@pytest.fixture(scope="module")
def best() -> CpuA8Linear:
    """This CPU's build on its first path (VNNI, else AVX2, else the plain loop)."""
    return CpuA8Linear.build()


def reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 [M, N], unrounded: the int8 rows times the float32-defined W, times the rows'
    scales, plus the bias."""
    values, scales = quantize_rows_int8(x)
    y = (values.double() @ w.dequantize_stored(torch.float64).T) * scales.double()
    return y if bias is None else y + bias.double()


def tolerance(
    x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """float64 [M, N]. The kernel's per-group sums are exact int32; then s * acc + o * xqsum
    per group (G groups), the row's scale and the bias take at most 2G + 3 float32 roundings,
    each off by 2^-24 of a partial sum bounded by T = a sum_k |xq_k| (|s| q_k + |o|) + |b|; a
    bf16 result's one rounding adds half a bf16 step: |got - y| <= 2^-8 |y| + 2^-24 (2G + 3) T
    (float32: without the 2^-8 |y|)."""
    values, scales = quantize_rows_int8(x)
    groups = torch.arange(w.in_features) // w.group_size
    terms = w.scales.double()[:, groups].abs() * w.values().double()
    terms = terms + w.offsets.double()[:, groups].abs()
    total = (values.double().abs() @ terms.T) * scales.double()
    if bias is not None:
        total = total + bias.double().abs()
    e = 2.0**-24 * (2 * w.num_groups + 3) * total
    if dtype == torch.float32:
        return e
    return 2.0**-8 * reference(x, w, bias).abs() + e


def outside(got: torch.Tensor, x: torch.Tensor, w: IntWeight, b: torch.Tensor | None):
    assert got.dtype == x.dtype and got.dtype in (torch.bfloat16, torch.float32), got.dtype
    return (got.double() - reference(x, w, b)).abs() > tolerance(x, w, b, got.dtype)


def assert_matches(
    got: torch.Tensor, x: torch.Tensor, w: IntWeight, b: torch.Tensor | None
) -> None:
    """Every element within the tolerance and, for bf16, nearly all (99%, one more allowed)
    equal to the exact result rounded to bf16: with exact integer sums, only a rounding tie or a
    result within 2^-24 of one may differ, so a row quantized differently from
    quantize_rows_int8 fails here. (float32 results: the tolerance is of float32 roundings
    alone, about 2^-24 of |y|, which a row quantized differently exceeds.)"""
    assert got.shape == (*x.shape[:-1], w.out_features), got.shape
    bad = outside(got, x, w, b)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} beyond tolerance; first at {list(i)}: got "
            f"{got[i].item()}, exact {reference(x, w, b)[i].item()}"
        )
    if got.dtype == torch.bfloat16:
        differ = int((got != reference(x, w, b).to(torch.bfloat16)).sum())
        assert differ <= 0.01 * got.numel() + 1, (differ, got.numel())


def widened(rows: torch.Tensor) -> torch.Tensor:
    """float32 [m, k]: the same values, rows k + 3 apart with NaN in between as well."""
    m, k = rows.shape
    storage = torch.full((m, k + 3), float("nan"))
    storage[:, :k] = rows.float()
    return storage[:, :k]


def test_layout_element_by_element():
    gen = torch.Generator().manual_seed(0)
    n, k = 37, 10  # two blocks (the second of 5 columns), 3 quads (the last with 2 k)
    for kind, top in ((4, 16), (8, 256)):
        q = torch.randint(0, top, (n, k), generator=gen)
        packed = a8_layout(q, kind)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 64 if kind == 4 else 128)

        def at(row: int, col: int, q: torch.Tensor = q) -> int:
            return int(q[row, col]) if row < n and col < k else 0

        for j in range(2):
            for t in range(3):
                for c in range(16):
                    for kk in range(4):
                        lo, hi = at(32 * j + c, 4 * t + kk), at(32 * j + 16 + c, 4 * t + kk)
                        if kind == 4:
                            assert int(packed[j, t, 4 * c + kk]) == lo | hi << 4
                        else:
                            assert int(packed[j, t, 4 * c + kk]) == lo
                            assert int(packed[j, t, 64 + 4 * c + kk]) == hi


def test_pack_a8_weight_scales_offsets_and_kinds():
    gen = torch.Generator().manual_seed(1)
    for bits, kind in ((4, 4), (5, 8), (8, 8)):
        w = random_weight(bits, 40, 70, 32, gen)
        p = pack_a8_weight(w)
        assert p.kind == kind and p.group_quads == 8 and (p.in_features, p.out_features) == (70, 40)
        assert p.scales.shape == p.offsets.shape == (2, 3, 32)
        for n in range(64):
            for g in range(3):
                s = float(w.scales[n, g]) if n < 40 else 0.0
                o = float(w.offsets[n, g]) if n < 40 else 0.0
                assert float(p.scales[n // 32, g, n % 32]) == s
                assert float(p.offsets[n // 32, g, n % 32]) == o
    assert pack_a8_weight(random_weight(4, 8, 70, 70, gen)).group_quads == 18
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_a8_weight(random_weight(4, 8, 70, 30, gen))


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("group", [32, 128, "one"])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (40, 70), (100, 130), (33, 35)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(kernel, bits, group, n, k, bias):
    gen = torch.Generator().manual_seed(bits * 100_000 + n * 1000 + k + (7 if bias else 0))
    w = random_weight(bits, n, k, k if group == "one" else group, gen, zero_points=n % 2 == 0)
    packed = pack_a8_weight(w)
    b = torch.randn(n, generator=gen) if bias else None
    for m in (1, 2, 3, 4, 5, 6, 7, 17, 64):
        rows = rows_with_nan_after(m, k, gen)
        for x in (rows, widened(rows)) if m in (1, 4, 17) else (rows,):
            got = kernel.linear(x, packed, b)
            assert not got.isnan().any()
            assert_matches(got, x, w, b)


def test_rows_of_zeros_and_of_one_large_value(best):
    """A row of zeros (scale FLT_MIN / 127, every xq 0) gives the bias; a row whose one large
    value sets the scale rounds the rest to few levels, as quantize_rows_int8 does."""
    gen = torch.Generator().manual_seed(2)
    w = random_weight(4, 32, 64, 32, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    x[0] = 0
    x[1, 5] = 1000.0
    b = torch.randn(32, generator=gen)
    got = best.linear(x, pack_a8_weight(w), b)
    assert torch.equal(got[0], b.to(torch.bfloat16))
    assert_matches(got, x, w, b)


def corrupt(packed: A8Packed, how: str) -> A8Packed:
    q, scales, offsets = packed.q.clone(), packed.scales, packed.offsets
    if how == "nibbles swapped":  # column c and column 16 + c exchanged (kind 4)
        q = (q >> 4) | (q << 4)
    elif how == "k reversed":  # the four k of every lane in reverse order
        q = q.reshape(*q.shape[:2], -1, 4).flip(-1).reshape(q.shape)
    elif how == "halves swapped":  # columns 0-15 and 16-31 of each block (kind 8)
        q = torch.cat([q[..., 64:], q[..., :64]], dim=-1)
    elif how == "wrong group":  # each group's scales and offsets from the next group
        scales, offsets = scales.roll(1, dims=1), offsets.roll(1, dims=1)
    elif how == "offset sign":
        offsets = -offsets
    else:
        raise AssertionError(how)
    return packed._replace(q=q.contiguous(), scales=scales.contiguous(), offsets=offsets)


@pytest.mark.parametrize(
    ("bits", "how"),
    [
        (4, "nibbles swapped"),
        (4, "k reversed"),
        (4, "wrong group"),
        (4, "offset sign"),
        (8, "k reversed"),
        (8, "halves swapped"),
        (8, "wrong group"),
        (8, "offset sign"),
    ],
)
def test_corrupted_layouts_fail_the_tolerance(best, bits, how):
    gen = torch.Generator().manual_seed(bits * 10 + len(how))
    w = random_weight(bits, 64, 256, 32, gen, zero_points=False)
    packed = pack_a8_weight(w)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    assert_matches(best.linear(x, packed, None), x, w, None)
    wrong = best.linear(x, corrupt(packed, how), None)
    assert outside(wrong, x, w, None).float().mean() > 0.5, how


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_the_batch(kernel, bits):
    """Row r computed alone, in batches of every tile remainder, and in rows split over more
    threads than blocks: bit for bit the same."""
    gen = torch.Generator().manual_seed(4 + bits)
    w = random_weight(bits, 96, 130, 32, gen)
    packed = pack_a8_weight(w)
    x = torch.randn(64, 130, generator=gen).to(torch.bfloat16)
    batch = kernel.linear(x, packed, None)
    assert_matches(batch, x, w, None)
    assert_rows_independent(lambda rows: kernel.linear(rows, packed, None), x, batch)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paths_agree_bit_for_bit_and_strided_inputs(bits, dtype):
    """Every path's int32 sums are exact and their scaling the same float32 operations in the
    same order: equal results, for rows read with a stride."""
    gen = torch.Generator().manual_seed(6 + bits)
    w = random_weight(bits, 250, 1022, 128, gen)
    packed = pack_a8_weight(w)
    wide = torch.randn(7, 2044, generator=gen).to(dtype)
    x = wide[:, ::2]
    outs = {
        (level, path): build(level, path).linear(x, packed, None)
        for (level, path), needs in BUILDS.items()
        if needs is None or needs in FLAGS
    }
    for got in outs.values():
        assert_matches(got, x, w, None)
        assert torch.equal(got, outs["portable", "plain"])


def test_launcher_rejects_mismatched_shapes(best):
    gen = torch.Generator().manual_seed(7)
    packed = pack_a8_weight(random_weight(4, 64, 48, 16, gen))
    x = torch.randn(3, 48).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        best.linear(torch.randn(3, 52).to(torch.bfloat16), packed, None)
    with pytest.raises(AssertionError):
        best.linear(torch.randn(3, 48).half(), packed, None)  # float16 input
    with pytest.raises(AssertionError):
        best.linear(x, packed, torch.zeros(63))
    with pytest.raises(AssertionError):
        best.linear(x, packed._replace(kind=8), None)  # 64-byte quads read as 128
    with pytest.raises(AssertionError):
        best.linear(x, packed._replace(group_quads=8), None)
