"""Integer weight-only linears on CPUs (W4A16, W8A16): the launcher of cpu_int_linear.cpp
(built once, like the other CPU kernels, through cpu_build.py), and `pack_int_weight`, which
repacks batchpage.quant's IntWeight into the kernel's layout once, at bind.

Why a kernel: dequantizing to bf16 and calling a bf16 linear reads the weight four (int4) or two
(int8) times over and writes it once, where a decode step's linears are bound by reading their
weights. This kernel reads the packed integers once, in the order stored (k-quads of 32-column
blocks, 64 bytes per quad at 4 bits), and turns them into bf16 operands of AVX512-BF16's
vdpbf16ps in registers without an integer-to-float conversion: the bf16 with bits 0x4300 | q
is 128 + q exactly for q < 128. Per group, acc = sum (q + C) * x, and the scale and the offset
enter once per group and column, y += s * acc + (o - C * s) * sum(x over the group); the packing
stores o - C * s in float32, or, where every s and o is a float16 value (a GGUF file's), s and o
in float16, from which the kernel makes the same o - C * s. Measured against the bf16 kernel
and F.linear: `python -m jobs.bench.int_linears`.

Byte-stored q (5 to 8 bits) are one byte each; 8-bit q are split in the kernel into their low
7 bits (0x4300 | lo7 = 128 + lo7) and bit 7 ((w & 0x80) | 0x4300 = 128 or 256, bit 7 being the
bf16 exponent's lowest), two vdpbf16ps into one accumulator, C = 256. 5- to 7-bit q need one.
FP8 e4m3 weights (W = s * fp8(q) per block of inputs) are their byte codes in the same layout,
widened exactly in registers (the .cpp's kind 9), C = 0.

Without AVX512-BF16 the library builds an AVX2 + FMA path (the same sums widened to float32) or,
without AVX2, a plain loop over the same layout (`native` is then False; `path` says which).
float32 x (a float32 engine, which then keeps its quantized weights packed) always takes that
float32 path (AVX-512F or AVX2 where the build has them: `wide_path`) and gives float32 y:
vdpbf16ps would round its activations to bf16.
Act order (IntWeight.perm) is the caller's: it permutes x's columns, the kernel multiplies the
stored columns.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_build import build_extension
from batchpage.quant.int_weight import IntWeight

SOURCE = Path(__file__).with_name("cpu_int_linear.cpp")  # shipped in the wheel beside this file

COLUMNS = 32  # a packed block's columns, kCols in the .cpp
QUAD = 4  # k per packed quad
BYTES_PER_QUAD = {4: 64, 7: 128, 8: 128, 9: 128}
BIAS = {4: 128, 7: 128, 8: 256, 9: 0}  # C: what the kernel adds to every q, by kind


class IntPacked(NamedTuple):
    """An IntWeight in the kernel's layout (cpu_int_linear.cpp's header)."""

    q: torch.Tensor  # uint8 [ceil(N / 32), ceil(K / 4), 64 (kind 4) or 128]
    scales: torch.Tensor  # float32 or float16 [ceil(N / 32), G, 32]
    # scales' dtype [ceil(N / 32), G, 32]: float32 offset - BIAS[kind] * scale, or float16 offset
    # (the kernel takes BIAS[kind] * scale off, in float32: the same value)
    offsets: torch.Tensor
    kind: int  # 4: 4-bit q; 7: q < 128 in bytes (5 to 7 bits); 8: 8-bit q; 9: FP8 e4m3 codes
    group_quads: int  # quads per group: group_size / 4, or ceil(K / 4) for one group
    in_features: int  # K
    out_features: int  # N


def kind_of(w: IntWeight) -> int:
    if w.float8:
        return 9
    return 4 if w.storage_bits == 4 else (7 if w.bits <= 7 else 8)


def stored_codes(w: IntWeight) -> torch.Tensor:  # uint8 [N, K]: q, or FP8's byte codes
    return w.packed if w.float8 else w.codes()


def quad_layout(
    q: torch.Tensor,  # int [N, K], values below 2^8
    kind: int,
) -> torch.Tensor:  # uint8 [ceil(N / 32), ceil(K / 4), BYTES_PER_QUAD[kind]]
    """Quad t of block j: for pair p (k = 4t + 2p + kk), half h (columns 32j + 16h + c) and lane
    l = 2c + kk, byte 32h + l holds pair 0's q in its low nibble and pair 1's in its high (kind
    4), or byte 64p + 32h + l holds it (kinds 7 and 8); zero past N and K."""
    n, k = q.shape
    blocks, quads = -(-n // COLUMNS), -(-k // QUAD)
    # In bytes: every q fits one, and a bind repacks every layer through here.
    padded = F.pad(q.to(torch.uint8), (0, QUAD * quads - k, 0, blocks * COLUMNS - n))
    # [NB, 2h, 16c, KQ, 2p, 2kk] -> [NB, KQ, p, h, c, kk]
    split = padded.reshape(blocks, 2, COLUMNS // 2, quads, 2, 2).permute(0, 3, 4, 1, 2, 5)
    if kind == 4:
        return (split[:, :, 0] | (split[:, :, 1] << 4)).to(torch.uint8).reshape(blocks, quads, 64)
    return split.to(torch.uint8).reshape(blocks, quads, 128)


def pack_int_weight(w: IntWeight) -> IntPacked:
    """The kernel's layout of `w`'s stored columns (act order stays the caller's)."""
    k, n, groups = w.in_features, w.out_features, w.num_groups
    if groups > 1 and w.group_size % QUAD:
        raise ValueError(
            f"the CPU int kernel needs a group size that is a multiple of {QUAD} (or one group), "
            f"not {w.group_size}"
        )
    kind = kind_of(w)
    blocks = -(-n // COLUMNS)
    group_quads = w.group_size // QUAD if groups > 1 else -(-k // QUAD)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G, 32]
        padded = F.pad(t, (0, 0, 0, blocks * COLUMNS - n))
        return padded.reshape(blocks, COLUMNS, groups).transpose(1, 2).contiguous()

    scales, offsets = w.scales.detach().cpu().float(), w.offsets.detach().cpu().float()
    if _exact_in_half(scales) and _exact_in_half(offsets):
        # A GGUF's scales and offsets are float16 in the file: held so, they take half the bytes
        # of float32 ones, which every step reads with the values
        scales, offsets = scales.half(), offsets.half()
    else:
        offsets = offsets - BIAS[kind] * scales
    return IntPacked(
        quad_layout(stored_codes(w).cpu(), kind).contiguous(),
        per_block(scales),
        per_block(offsets),
        kind,
        group_quads,
        k,
        n,
    )


def _exact_in_half(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t))


def dequantize_rows(
    packed: IntPacked,
    ids: torch.Tensor,  # int64 [R], output rows (columns of y)
) -> torch.Tensor:  # float32 [R, K]: W[ids], in stored column order
    """Rows of the weight `packed` holds, read back from the kernel's layout and dequantized
    (a tied model's embedding lookups from its quantized head): only those rows' bytes are
    read."""
    k, kind = packed.in_features, packed.kind
    block, col = ids // COLUMNS, ids % COLUMNS
    lane = 32 * (col // 16) + 2 * (col % 16)  # [R]: the byte of (k even, pair 0)
    quads = torch.arange(packed.q.shape[1], device=ids.device)
    if kind == 4:  # two bytes a quad: pair 0 in the low nibbles, pair 1 in the high
        at = torch.stack([lane, lane + 1], dim=1)
        two = packed.q[block[:, None, None], quads[None, :, None], at[:, None, :]].to(torch.int32)
        q = torch.cat([two & 0xF, two >> 4], dim=2)
    else:
        at = torch.stack([lane, lane + 1, lane + 64, lane + 65], dim=1)
        q = packed.q[block[:, None, None], quads[None, :, None], at[:, None, :]].to(torch.int32)
    q = q.reshape(len(ids), -1)[:, :k]
    if kind == 9:  # byte codes -> their FP8 values
        q = q.to(torch.uint8).view(torch.float8_e4m3fn).float()
    groups = torch.arange(k, device=ids.device) // (QUAD * packed.group_quads)
    scales = packed.scales[block, :, col][:, groups].float()
    offsets = packed.offsets[block, :, col][:, groups].float()
    if packed.scales.dtype == torch.float32:  # o - C * s: C * s back on (exact)
        offsets = offsets + BIAS[kind] * scales
    return scales * q + offsets


class CpuIntLinear:
    """The compiled kernel. Build with `CpuIntLinear.build()`."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuIntLinear:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(build_extension(SOURCE, "batchpage_cpu_int_linear", "the int linear", verbose))

    @property
    def path(self) -> str:
        """The build's instructions for bf16 x: "avx512_bf16", "avx512" (AVX-512F without
        BF16: the float32 tiles), "avx2" (AVX2 + FMA) or "plain"."""
        return str(self._module.path())

    @property
    def wide_path(self) -> str:
        """The build's instructions for float32 x: "avx512" (AVX-512F), "avx2" (AVX2 + FMA)
        or "plain"."""
        return str(self._module.wide_path())

    @property
    def native(self) -> bool:
        """Whether this build runs on AVX512-BF16."""
        return self.path == "avx512_bf16"

    @property
    def raw(self) -> object:
        """The compiled library: `raw.linear(out, rows, q, scales, offsets, bias, kind,
        group_quads)` as `linear` calls it, unchecked, for a caller that checked its shapes once;
        `out` is a preallocated [M, N] of the rows' dtype, contiguous."""
        return self._module

    def linear(
        self,
        x: torch.Tensor,  # bf16 or float32 [..., K]
        packed: IntPacked,
        bias: torch.Tensor | None,  # float32 [N]
    ) -> torch.Tensor:  # x's dtype [..., N]
        k, n = packed.in_features, packed.out_features
        blocks, groups = -(-n // COLUMNS), packed.scales.shape[1]
        assert x.device.type == "cpu", x.device
        assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
        assert x.shape[-1] == k, (x.shape, k)
        assert packed.kind in BYTES_PER_QUAD, packed.kind
        quads = -(-k // QUAD)
        assert packed.q.dtype == torch.uint8 and packed.q.is_contiguous()
        assert packed.q.shape == (blocks, quads, BYTES_PER_QUAD[packed.kind]), packed.q.shape
        assert groups == -(-quads // packed.group_quads), (groups, quads, packed.group_quads)
        assert packed.scales.dtype in (torch.float32, torch.float16), packed.scales.dtype
        for t in (packed.scales, packed.offsets):
            assert t.dtype == packed.scales.dtype and t.is_contiguous(), t.dtype
            assert t.shape == (blocks, groups, COLUMNS), (t.shape, blocks, groups)
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.shape == (n,), (bias.dtype, bias.shape)
            assert bias.is_contiguous()
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], n, dtype=x.dtype)
        self._module.linear(
            out, rows, packed.q, packed.scales, packed.offsets, bias, packed.kind,
            packed.group_quads,
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], n)
