"""The integer weight-only linear kernel (kernels/cpu_int_linear.cpp) against a float64 torch
reference (IntWeight.dequantize_stored and x in float64): the packed layout element by element,
4-, 6- and 8-bit weights and FP8 e4m3 codes (every one of them), groups of 32, 128 and one,
every k, column and row tail, a bias, NaN after each row's end, results that do not depend on
M, and corrupted layouts that must fail the tolerance. Every build runs on every CPU that can:
AVX512-BF16, the AVX-512 and AVX2 levels' float32 tiles and the plain loop (the portable
build), all over the same layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_build import build_extension
from batchpage.kernels.cpu_int_linear import (
    BIAS,
    SOURCE,
    CpuIntLinear,
    IntPacked,
    dequantize_rows,
    kind_of,
    pack_int_weight,
    quad_layout,
)
from batchpage.quant.int_weight import IntWeight, pack_nibbles

FLAGS = cpu_flags()
BUILDS = {  # path -> (the instruction-set level built for, None: this CPU's; the flag it needs)
    "avx512_bf16": (None, "avx512_bf16"),
    "avx512": ("avx512", "avx512f"),  # the float32 tiles, 16 lanes, for bf16 too
    "avx2": ("avx2", "avx2"),
    "plain": ("portable", None),
}


def build(path: str) -> CpuIntLinear:
    level, needs = BUILDS[path]
    if needs is not None and needs not in FLAGS:
        pytest.skip(f"this CPU has no {needs}")
    if level is None:
        built = CpuIntLinear.build()
    else:
        module = build_extension(SOURCE, "batchpage_cpu_int_linear", "the int linear", isa=level)
        built = CpuIntLinear(module)
    assert built.path == path
    return built


@pytest.fixture(scope="module", params=list(BUILDS))
def kernel(request) -> CpuIntLinear:
    return build(request.param)


@pytest.fixture(scope="module")
def best() -> CpuIntLinear:
    return build(
        "avx512_bf16" if "avx512_bf16" in FLAGS else "avx2" if "avx2" in FLAGS else "plain"
    )


def random_weight(
    bits: int, n: int, k: int, group_size: int, gen: torch.Generator, zero_points: bool = True
) -> IntWeight:
    """q uniform over its range; per-group scales of a k**-0.5-sized weight; offsets -s * z with
    an integer zero point z (AWQ / GPTQ), or any float (a K-quant's minimum)."""
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group_size)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * k**-0.5 / 2 ** (bits - 2)
    if zero_points:
        offsets = -scales * torch.randint(0, 2**bits, (n, groups), generator=gen)
    else:
        offsets = torch.randn(n, groups, generator=gen) * k**-0.5
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, group_size, k)


def random_fp8_weight(n: int, k: int, group_size: int, gen: torch.Generator) -> IntWeight:
    """FP8 e4m3 codes uniform over the 254 that are not NaN (subnormals, zeros of both signs
    and the largest, 448, among them), per-group scales as a block-scaled checkpoint's."""
    codes = torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x80  # NaN -> -0
    groups = -(-k // group_size)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * k**-0.5 / 64
    return IntWeight(codes, scales, torch.zeros(n, groups), 8, group_size, k, None, True)


def stored_values(w: IntWeight) -> torch.Tensor:  # float64 [N, K]: q, or FP8's values
    if w.float8:
        return w.packed.view(torch.float8_e4m3fn).double()
    return w.values().double()


def rows_with_nan_after(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [m, k] whose rows are k + 3 apart with NaN in between: a kernel reading past a row's
    end (an odd k's last pair, a partial quad) makes NaN."""
    storage = torch.randn(m, k + 3, generator=gen).to(torch.bfloat16)
    storage[:, k:] = float("nan")
    return storage[:, :k]


def reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 [M, N], unrounded: the exact product of the bf16 x and the float32-defined W."""
    y = x.double() @ w.dequantize_stored(torch.float64).T
    return y if bias is None else y + bias.double()


def float32_error(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """e below: how far the kernel's float32 sums may be from the exact result."""
    c = BIAS[kind_of(w)]
    groups = torch.arange(w.in_features) // w.group_size
    s = w.scales.double()[:, groups]
    o = w.offsets.double()[:, groups]
    terms = s.abs() * (stored_values(w) + c).abs() + (o - c * s).abs()
    total = x.double().abs() @ terms.T
    if bias is not None:
        total = total + bias.double().abs()
    length = min(w.group_size, w.in_features)
    return 2.0**-24 * (length + w.num_groups + 4) * total


def tolerance(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 [M, N]: how far the kernel's bf16 result may be from the exact one.

    The kernel sums (q + C) * x per group in float32, then s * acc + (o - C * s) * xsum per group
    and the bias: each term goes through at most L + G + 4 float32 roundings (L: the group's
    length, G groups), each off by 2^-24 of a partial sum, which is bounded by
    T = sum_k |x_k| (|s| (q_k + C) + |o - C s|). So the float32 result is within e = 2^-24 (L + G
    + 4) T (+ the bias's 2^-24) of the exact y, and its one rounding to bf16 adds at most half a
    bf16 step, 2^-8 |y|: |got - y| <= 2^-8 |y| + 2 e. A wrong nibble, group, offset sign or
    plane moves most results by about |y| itself."""
    return 2.0**-8 * reference(x, w, bias).abs() + 2 * float32_error(x, w, bias)


def outside(got: torch.Tensor, x: torch.Tensor, w: IntWeight, b: torch.Tensor | None):
    """Boolean [M, N]: where the kernel's result is beyond the tolerance."""
    assert got.dtype == torch.bfloat16
    return (got.double() - reference(x, w, b)).abs() > tolerance(x, w, b)


def assert_matches(
    got: torch.Tensor,
    x: torch.Tensor,
    w: IntWeight,
    b: torch.Tensor | None,
    exact_share: float = 0.97,
) -> None:
    """Every element within the tolerance, and nearly all (`exact_share`, one more allowed)
    equal to the exact result rounded to bf16: the bound above is a worst case, several bf16
    steps wide for long groups, while the kernel's float32 sums are off by far less in practice,
    so a result off by a step or two in many places fails here."""
    assert got.shape == (*x.shape[:-1], w.out_features), got.shape
    bad = outside(got, x, w, b)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} beyond tolerance; first at {list(i)}: got "
            f"{got[i].item()}, exact {reference(x, w, b)[i].item()}, tolerance "
            f"{tolerance(x, w, b)[i].item()}"
        )
    differ = int((got != reference(x, w, b).to(torch.bfloat16)).sum())
    assert differ <= (1 - exact_share) * got.numel() + 1, (differ, got.numel())


def test_quad_layout_element_by_element():
    gen = torch.Generator().manual_seed(0)
    n, k = 37, 10  # two blocks (the second of 5 columns), 3 quads (the last with 2 k)
    for kind, top in ((4, 16), (8, 256)):
        q = torch.randint(0, top, (n, k), generator=gen)
        packed = quad_layout(q, kind)
        assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 64 if kind == 4 else 128)

        def at(row: int, col: int, q: torch.Tensor = q) -> int:
            return int(q[row, col]) if row < n and col < k else 0

        for j in range(2):
            for t in range(3):
                for h in range(2):
                    for lane in range(32):
                        row, kk = 32 * j + 16 * h + lane // 2, lane % 2
                        pair0, pair1 = at(row, 4 * t + kk), at(row, 4 * t + 2 + kk)
                        if kind == 4:
                            assert int(packed[j, t, 32 * h + lane]) == pair0 | pair1 << 4
                        else:
                            assert int(packed[j, t, 32 * h + lane]) == pair0
                            assert int(packed[j, t, 64 + 32 * h + lane]) == pair1


def test_pack_int_weight_scales_offsets_and_kinds():
    gen = torch.Generator().manual_seed(1)
    for bits, kind in ((4, 4), (5, 7), (6, 7), (7, 7), (8, 8)):
        w = random_weight(bits, 40, 70, 32, gen)
        p = pack_int_weight(w)
        assert p.kind == kind and p.group_quads == 8 and (p.in_features, p.out_features) == (70, 40)
        assert p.scales.shape == p.offsets.shape == (2, 3, 32)
        for n in range(64):
            for g in range(3):
                s = float(w.scales[n, g]) if n < 40 else 0.0
                o = float(w.offsets[n, g]) if n < 40 else 0.0
                assert float(p.scales[n // 32, g, n % 32]) == s
                want = torch.tensor(o, dtype=torch.float32) - BIAS[kind] * torch.tensor(s)
                assert float(p.offsets[n // 32, g, n % 32]) == float(want)
    one = pack_int_weight(random_weight(4, 8, 70, 70, gen))
    assert one.group_quads == 18 and one.scales.shape == (1, 1, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int_weight(random_weight(4, 8, 70, 30, gen))


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("group", [32, 128, "one"])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (40, 70), (100, 130), (33, 35), (32, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(kernel, bits, group, n, k, bias):
    gen = torch.Generator().manual_seed(bits * 100_000 + n * 1000 + k + (7 if bias else 0))
    group_size = k if group == "one" else group
    w = random_weight(bits, n, k, group_size, gen, zero_points=n % 2 == 0)
    packed = pack_int_weight(w)
    b = torch.randn(n, generator=gen) if bias else None
    for m in (1, 3, 8, 17, 64):
        x = rows_with_nan_after(m, k, gen)
        got = kernel.linear(x, packed, b)
        assert not got.isnan().any()
        assert_matches(got, x, w, b)


@pytest.mark.parametrize("bits", [5, 7])
def test_other_byte_widths(kernel, bits):
    gen = torch.Generator().manual_seed(bits)
    w = random_weight(bits, 72, 200, 32, gen, zero_points=False)
    x = torch.randn(9, 200, generator=gen).to(torch.bfloat16)
    assert_matches(kernel.linear(x, pack_int_weight(w), None), x, w, None)


def test_group_larger_than_k_is_one_group(kernel):
    gen = torch.Generator().manual_seed(2)
    w = random_weight(4, 48, 70, 128, gen)  # ceil(70 / 128) = 1 group
    assert pack_int_weight(w).group_quads == 18
    x = rows_with_nan_after(5, 70, gen)
    assert_matches(kernel.linear(x, pack_int_weight(w), None), x, w, None)


def test_tolerance_is_a_few_bf16_steps():
    """The exact result rounded to bf16 meets the checks; moved by two bf16 steps it fails the
    tolerance in most places (groups of 32), by one step it fails the exact-share check."""
    gen = torch.Generator().manual_seed(3)
    w = random_weight(4, 64, 256, 32, gen)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    rounded = reference(x, w, None).to(torch.bfloat16)
    assert_matches(rounded, x, w, None)
    step = (rounded.double().abs() * 2.0**-7).to(torch.bfloat16)  # one step, or just under
    two_off = (rounded.double() + 2 * step).to(torch.bfloat16)
    assert outside(two_off, x, w, None).float().mean() > 0.5
    with pytest.raises(AssertionError):
        assert_matches((rounded.double() + step).to(torch.bfloat16), x, w, None)


def corrupt(packed: IntPacked, how: str) -> IntPacked:
    q, scales, offsets = packed.q.clone(), packed.scales, packed.offsets
    if how == "nibbles swapped":  # pair 0 and pair 1 of every 4-bit quad exchanged
        q = (q >> 4) | (q << 4)
    elif how == "k pairs transposed":  # k even and k odd exchanged (lanes 2c and 2c + 1)
        q = q.reshape(*q.shape[:2], -1, 2).flip(-1).reshape(q.shape)
    elif how == "planes swapped":  # the byte planes of pair 0 and pair 1 (kinds 7, 8)
        q = torch.cat([q[..., 64:], q[..., :64]], dim=-1)
    elif how == "wrong group":  # each group's scales and offsets from the next group
        scales, offsets = scales.roll(1, dims=1), offsets.roll(1, dims=1)
    elif how == "offset sign":  # -o - C s instead of o - C s
        c = BIAS[packed.kind]
        offsets = -(offsets + c * scales) - c * scales
    elif how == "offset without C":  # o, as if the kernel added nothing to q
        offsets = offsets + BIAS[packed.kind] * scales
    else:
        raise AssertionError(how)
    return packed._replace(q=q.contiguous(), scales=scales.contiguous(), offsets=offsets)


@pytest.mark.parametrize(
    ("bits", "how"),
    [
        (4, "nibbles swapped"),
        (4, "k pairs transposed"),
        (4, "wrong group"),
        (4, "offset sign"),
        (4, "offset without C"),
        (8, "k pairs transposed"),
        (8, "planes swapped"),
        (8, "wrong group"),
        (8, "offset sign"),
        (8, "offset without C"),
        (6, "planes swapped"),
    ],
)
def test_corrupted_layouts_fail_the_tolerance(best, bits, how):
    """The tolerance catches each mistake a layout or epilogue could make: the intact weight
    passes and the corrupted one lands outside it in most places."""
    gen = torch.Generator().manual_seed(bits * 10 + len(how))
    w = random_weight(bits, 64, 256, 32, gen, zero_points=False)
    packed = pack_int_weight(w)
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
    packed = pack_int_weight(w)
    x = torch.randn(64, 130, generator=gen).to(torch.bfloat16)
    batch = kernel.linear(x, packed, None)
    assert_matches(batch, x, w, None)
    assert_rows_independent(lambda rows: kernel.linear(rows, packed, None), x, batch)


def assert_rows_independent(
    run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: torch.Tensor
) -> None:
    """`run` of rows of x [64, K] alone, in batches of every tile remainder, and split over 8
    threads (more than the 3 column blocks of a 96-column weight, so rows are split too) gives
    `batch`'s rows bit for bit."""
    for r in (0, 5, 17, 63):
        assert torch.equal(run(x[r : r + 1]), batch[r : r + 1])
    for size in (2, 3, 5, 7, 13, 33):
        assert torch.equal(run(x[:size]), batch[:size])
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        for size in (1, 9, 64):
            assert torch.equal(run(x[:size]), batch[:size])
    finally:
        torch.set_num_threads(before)


def test_batched_and_strided_inputs(kernel):
    gen = torch.Generator().manual_seed(5)
    w = random_weight(4, 64, 48, 16, gen)
    packed = pack_int_weight(w)
    x3 = torch.randn(2, 9, 48, generator=gen).to(torch.bfloat16)
    got = kernel.linear(x3, packed, None)
    assert got.shape == (2, 9, 64)
    assert_matches(got.reshape(18, 64), x3.reshape(18, 48), w, None)
    wide = torch.randn(11, 96, generator=gen).to(torch.bfloat16)
    for x in (wide[:, 16:64], wide[:, ::2]):
        assert_matches(kernel.linear(x, packed, None), x, w, None)
    assert kernel.linear(wide[:0, :48], packed, None).shape == (0, 64)


def test_results_agree_across_builds():
    """The three builds read one layout: their results are each within the tolerance (checked
    above) and, here, within one bf16 step of each other on a large shape."""
    gen = torch.Generator().manual_seed(6)
    w = random_weight(4, 256, 1024, 128, gen)
    packed = pack_int_weight(w)
    x = torch.randn(5, 1024, generator=gen).to(torch.bfloat16)
    outs = {}
    for path, (_, needs) in BUILDS.items():
        if needs is None or needs in FLAGS:
            outs[path] = build(path).linear(x, packed, None)
    for got in outs.values():
        assert_matches(got, x, w, None)
        torch.testing.assert_close(got.float(), outs["plain"].float(), rtol=2**-7, atol=1e-5)


def test_launcher_rejects_mismatched_shapes(best):
    gen = torch.Generator().manual_seed(7)
    packed = pack_int_weight(random_weight(4, 64, 48, 16, gen))
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
        best.linear(x, packed._replace(group_quads=8), None)  # 3 groups of scales, 2 of quads
    with pytest.raises(AssertionError):
        best.linear(x, packed._replace(scales=packed.scales.double()), None)


def assert_float32_matches(got, x, w, b) -> None:
    """float32 x and y: every element within the float32 sums' bound of the exact result (no
    bf16 rounding at the end), and most far closer."""
    assert got.dtype == torch.float32 and got.shape == (*x.shape[:-1], w.out_features)
    want = reference(x, w, b)
    err = (got.double() - want).abs()
    bound = 2 * float32_error(x, w, b) + 2.0**-24 * want.abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize(("n", "k", "group"), [(64, 256, 32), (40, 70, "one"), (33, 35, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_activations_match_reference(kernel, bits, n, k, group, bias):
    """A float32 engine's rows: float32 x in, float32 y out, on every build (the AVX-512 build
    takes its AVX2 float32 tiles), with rows that hide NaN past their end."""
    gen = torch.Generator().manual_seed(bits * 7 + n)
    w = random_weight(bits, n, k, k if group == "one" else group, gen)
    b = torch.randn(n, generator=gen) if bias else None
    storage = torch.randn(9, k + 3, generator=gen)
    storage[:, k:] = float("nan")
    x = storage[:, :k]
    got = kernel.linear(x, pack_int_weight(w), b)
    assert_float32_matches(got, x, w, b)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_float32_row_does_not_depend_on_the_batch(kernel, bits):
    gen = torch.Generator().manual_seed(40 + bits)
    w = random_weight(bits, 96, 130, 32, gen)
    packed = pack_int_weight(w)
    x = torch.randn(64, 130, generator=gen)
    batch = kernel.linear(x, packed, None)
    assert_float32_matches(batch, x, w, None)
    assert_rows_independent(lambda rows: kernel.linear(rows, packed, None), x, batch)


def test_a_corrupted_layout_fails_the_float32_bound(best):
    gen = torch.Generator().manual_seed(41)
    w = random_weight(4, 64, 128, 32, gen)
    x = torch.randn(5, 128, generator=gen)
    got = best.linear(x, corrupt(pack_int_weight(w), "offset sign"), None)
    with pytest.raises(AssertionError):
        assert_float32_matches(got, x, w, None)


def test_float32_results_are_the_same_bits_on_every_fast_build():
    """The AVX-512 and AVX2 float32 tiles sum each output in the same order: the same bits, and
    the plain loop within the float32 bound."""
    gen = torch.Generator().manual_seed(42)
    w = random_weight(4, 96, 256, 64, gen)
    packed = pack_int_weight(w)
    x = torch.randn(7, 256, generator=gen)
    outs = {}
    for path, (_, needs) in BUILDS.items():
        if needs is None or needs in FLAGS:
            outs[path] = build(path).linear(x, packed, None)
    fast = [outs[p] for p in ("avx512_bf16", "avx512", "avx2") if p in outs]
    assert all(torch.equal(got, fast[0]) for got in fast)
    for got in outs.values():
        assert_float32_matches(got, x, w, None)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 256, 128), (40, 70, "one"), (33, 35, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_codes_match_reference(kernel, n, k, group, dtype):
    """FP8 block weights (kind 9): each code widened exactly in registers, on every build, for
    bf16 and float32 rows that hide NaN past their end (a bias on the even widths)."""
    gen = torch.Generator().manual_seed(n + k)
    w = random_fp8_weight(n, k, k if group == "one" else group, gen)
    packed = pack_int_weight(w)
    assert packed.kind == 9
    b = torch.randn(n, generator=gen) if n % 2 == 0 else None
    for m in (1, 5, 17):
        storage = torch.randn(m, k + 3, generator=gen).to(dtype)
        storage[:, k:] = float("nan")
        x = storage[:, :k]
        got = kernel.linear(x, packed, b)
        assert not got.isnan().any()
        if dtype == torch.float32:
            assert_float32_matches(got, x, w, b)
        else:
            assert_matches(got, x, w, b)


def test_every_fp8_code_reads_back_as_its_value(best):
    """One column per code, a one-hot row per input: y is each code's value times its scale
    (the rows a tied head's lookups read back too)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = len(codes)
    w = IntWeight(codes[None, :].repeat(32, 1), torch.full((32, 1), 0.5), torch.zeros(32, 1),
                  8, k, k, None, True)  # fmt: skip
    values = codes.view(torch.float8_e4m3fn).float() * 0.5
    packed = pack_int_weight(w)
    for dtype in (torch.float32, torch.bfloat16):
        got = best.linear(torch.eye(k, dtype=dtype), packed, None)
        assert torch.equal(got[:, 0].float(), values.to(dtype).float())
    rows = dequantize_rows(packed, torch.tensor([0, 31]))
    assert torch.equal(rows, values.expand(2, -1))


@pytest.mark.parametrize("how", ["k pairs transposed", "planes swapped", "wrong group"])
def test_a_corrupted_fp8_layout_fails_the_tolerance(best, how):
    gen = torch.Generator().manual_seed(len(how))
    w = random_fp8_weight(64, 256, 128, gen)
    packed = pack_int_weight(w)
    x = torch.randn(8, 256, generator=gen).to(torch.bfloat16)
    assert_matches(best.linear(x, packed, None), x, w, None)
    wrong = best.linear(x, corrupt(packed, how), None)
    assert outside(wrong, x, w, None).float().mean() > 0.5, how


def test_an_fp8_row_does_not_depend_on_the_batch(kernel):
    gen = torch.Generator().manual_seed(43)
    w = random_fp8_weight(96, 130, 128, gen)
    packed = pack_int_weight(w)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 130, generator=gen).to(dtype)
        batch = kernel.linear(x, packed, None)
        assert_rows_independent(lambda rows: kernel.linear(rows, packed, None), x, batch)
