"""Integer-weight linears with int8 activations (W8A8, W4A8): the launcher of
cpu_a8_linear.cpp (built once, like the other CPU kernels, through cpu_build.py), and
`pack_a8_weight`, which repacks batchpage.quant's IntWeight into the kernel's layout once, at
bind.

Why a kernel: where many rows run, an integer weight's linear is bound by arithmetic, not by
reading the weight, and integer multiply-adds come more to an instruction than float ones. The
kernel quantizes each row of x (float32 or bfloat16) to int8 with its own scale (max |x| / 127,
as batchpage.quant.activations.quantize_rows_int8), sums q * xq in int32, exactly, per group,
and applies the scale, the offset (times the row's int8 sum over the group) and the row's scale
in float32; y has x's dtype. Measured against the A16 int kernel and the bf16 linear:
`python -m jobs.bench.int_linears` (`--dtype float32` for the float32 linears an AVX2 CPU runs).

One library holds every path the build's instructions allow (`CpuA8Linear.paths`), over the same
layout and with the same results bit for bit: "avx512_vnni" (vpdpbusd: four byte products a
32-bit lane, 64 multiply-adds an instruction), "avx2" for CPUs without VNNI (vpmaddubsw on 4-bit
weights, 32 multiply-adds an instruction, with the sums kept below int16 saturation; vpmaddwd on
8-bit weights widened to int16, 16 an instruction: the .cpp's header says why), and "plain", a
loop on any CPU (the reference the others are tested against; never chosen by the engine).
`CpuA8Linear.build(path=...)` runs one of them; the engine measures each vector path as a
candidate of its own (ops/int_linear.py). Act order (IntWeight.perm) is the caller's: it
permutes x's columns, the kernel multiplies the stored columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_build import build_extension
from batchpage.quant.int_weight import IntWeight

SOURCE = Path(__file__).with_name("cpu_a8_linear.cpp")  # shipped in the wheel beside this file

COLUMNS = 32  # a packed block's columns, kCols in the .cpp
QUAD = 4  # k per packed quad: the four bytes vpdpbusd sums into one lane
BYTES_PER_QUAD = {4: 64, 8: 128}
PATHS = ("avx512_vnni", "avx2", "plain")  # by number, as the .cpp's Path
ROW_DTYPES = (torch.float32, torch.bfloat16)  # x's and y's


class A8Packed(NamedTuple):
    """An IntWeight in the kernel's layout (cpu_a8_linear.cpp's header)."""

    q: torch.Tensor  # uint8 [ceil(N / 32), ceil(K / 4), 64 (kind 4) or 128 (kind 8)]
    scales: torch.Tensor  # float32 [ceil(N / 32), G, 32]
    offsets: torch.Tensor  # float32 [ceil(N / 32), G, 32]
    kind: int  # 4: 4-bit q; 8: q < 256 in bytes (5 to 8 bits)
    group_quads: int  # quads per group: group_size / 4, or ceil(K / 4) for one group
    in_features: int  # K
    out_features: int  # N


def a8_layout(
    q: torch.Tensor,  # int [N, K], values below 2^8 (below 2^4 for kind 4)
    kind: int,
) -> torch.Tensor:  # uint8 [ceil(N / 32), ceil(K / 4), BYTES_PER_QUAD[kind]]
    """Quad t of block j: byte 4c + kk holds column 32j + c's q at k = 4t + kk in its low nibble
    and column 32j + 16 + c's in its high (kind 4), or byte 64h + 4c + kk holds column
    32j + 16h + c's (kind 8); zero past N and K."""
    n, k = q.shape
    blocks, quads = -(-n // COLUMNS), -(-k // QUAD)
    padded = F.pad(q.to(torch.int32), (0, QUAD * quads - k, 0, blocks * COLUMNS - n))
    # [NB, 2h, 16c, KQ, 4kk] -> [NB, KQ, h, c, kk]
    split = padded.reshape(blocks, 2, COLUMNS // 2, quads, QUAD).permute(0, 3, 1, 2, 4)
    if kind == 4:
        return (split[:, :, 0] | (split[:, :, 1] << 4)).to(torch.uint8).reshape(blocks, quads, 64)
    return split.to(torch.uint8).reshape(blocks, quads, 128)


def pack_a8_weight(w: IntWeight) -> A8Packed:
    """The kernel's layout of `w`'s stored columns (act order stays the caller's)."""
    k, n, groups = w.in_features, w.out_features, w.num_groups
    if groups > 1 and w.group_size % QUAD:
        raise ValueError(
            f"the CPU int8-activation kernel needs a group size that is a multiple of {QUAD} "
            f"(or one group), not {w.group_size}"
        )
    kind = 4 if w.storage_bits == 4 else 8
    blocks = -(-n // COLUMNS)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # float32 [N, G] -> [NB, G, 32]
        padded = F.pad(t.detach().cpu().float(), (0, 0, 0, blocks * COLUMNS - n))
        return padded.reshape(blocks, COLUMNS, groups).transpose(1, 2).contiguous()

    return A8Packed(
        a8_layout(w.values().cpu(), kind).contiguous(),
        per_block(w.scales),
        per_block(w.offsets),
        kind,
        w.group_size // QUAD if groups > 1 else -(-k // QUAD),
        k,
        n,
    )


def dequantize_rows(
    packed: A8Packed,
    ids: torch.Tensor,  # int64 [R], output rows (columns of y)
) -> torch.Tensor:  # float32 [R, K]: W[ids], in stored column order
    """Rows of the weight `packed` holds, read back from the kernel's layout and dequantized
    (a tied model's embedding lookups from its quantized head): only those rows' bytes are
    read."""
    k = packed.in_features
    block, col = ids // COLUMNS, ids % COLUMNS
    quads = torch.arange(packed.q.shape[1], device=ids.device)
    kk = torch.arange(QUAD, device=ids.device)
    if packed.kind == 4:  # columns 16 .. 31 of a block in the high nibbles
        at = 4 * (col % 16)[:, None] + kk
        raw = packed.q[block[:, None, None], quads[None, :, None], at[:, None, :]].to(torch.int32)
        q = (raw >> (4 * (col // 16))[:, None, None]) & 0xF
    else:
        at = 64 * (col // 16)[:, None] + 4 * (col % 16)[:, None] + kk
        q = packed.q[block[:, None, None], quads[None, :, None], at[:, None, :]].to(torch.int32)
    q = q.reshape(len(ids), -1)[:, :k]
    groups = torch.arange(k, device=ids.device) // (QUAD * packed.group_quads)
    return packed.scales[block, :, col][:, groups] * q + packed.offsets[block, :, col][:, groups]


class CpuA8Linear:
    """The compiled kernel, running one of its paths. Build with `CpuA8Linear.build()`."""

    def __init__(self, module: object, path: str | None = None) -> None:
        """`path`: one of the library's `paths` (default its first, the fastest by design)."""
        self._module = module
        available = tuple(str(p) for p in module.paths())
        self.path = available[0] if path is None else path
        if self.path not in available:
            raise ValueError(f"this build of the int8-activation linear has no {path!r} path")
        self._paths = available
        self._run = functools.partial(module.linear, PATHS.index(self.path))

    @classmethod
    def build(cls, verbose: bool = False, path: str | None = None) -> CpuA8Linear:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        module = build_extension(
            SOURCE, "batchpage_cpu_a8_linear", "the int8-activation linear", verbose
        )
        return cls(module, path)

    def with_path(self, path: str) -> CpuA8Linear:
        """The same library running `path`."""
        return CpuA8Linear(self._module, path)

    @property
    def paths(self) -> tuple[str, ...]:
        """The library's paths, fastest first by design: "avx512_vnni" (where the build has
        AVX512-VNNI), "avx2" (where it has AVX2), "plain" (always)."""
        return self._paths

    @property
    def native(self) -> bool:
        """Whether this path runs on vector instructions (not the plain loop)."""
        return self.path != "plain"

    @property
    def raw(self) -> object:
        """The compiled library (its name changes with its source)."""
        return self._module

    @property
    def run(self) -> Callable[..., None]:
        """This path's entry, unchecked, for a caller that checked its shapes once:
        `run(out, rows, q, scales, offsets, bias, kind, group_quads)` as `linear` calls it;
        `out` is a preallocated [M, N] of the rows' dtype, contiguous."""
        return self._run

    def linear(
        self,
        x: torch.Tensor,  # float32 or bf16 [..., K]
        packed: A8Packed,
        bias: torch.Tensor | None,  # float32 [N]
    ) -> torch.Tensor:  # x's dtype [..., N]
        assert x.device.type == "cpu" and x.dtype in ROW_DTYPES, (x.device, x.dtype)
        assert x.shape[-1] == packed.in_features, (x.shape, packed.in_features)
        _check(packed, bias)
        rows = x.reshape(-1, packed.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], packed.out_features, dtype=x.dtype)
        self._run(
            out, rows, packed.q, packed.scales, packed.offsets, bias, packed.kind,
            packed.group_quads,
        )  # fmt: skip
        return out.reshape(*x.shape[:-1], packed.out_features)

    def linear_int8(
        self,
        values: torch.Tensor,  # int8 [M, K]: rows already quantized
        row_scales: torch.Tensor,  # float32 [M]
        packed: A8Packed,
        bias: torch.Tensor | None,  # float32 [N]
        dtype: torch.dtype = torch.float32,  # the output's: float32 or bf16
    ) -> torch.Tensor:  # dtype [M, N]
        """(row_scales * values) @ W.T + bias: what `linear` computes after its quantization,
        for rows given as int8 (any value, -128 included)."""
        m, k = values.shape
        assert values.device.type == "cpu" and values.dtype == torch.int8, values.dtype
        assert k == packed.in_features and values.stride(1) == 1, (values.shape, values.stride())
        assert row_scales.dtype == torch.float32 and row_scales.shape == (m,), row_scales.shape
        assert row_scales.is_contiguous() and dtype in ROW_DTYPES, dtype
        _check(packed, bias)
        out = torch.empty(m, packed.out_features, dtype=dtype)
        self._module.linear_int8(
            PATHS.index(self.path), out, values, row_scales, packed.q, packed.scales,
            packed.offsets, bias, packed.kind, packed.group_quads,
        )  # fmt: skip
        return out


def _check(packed: A8Packed, bias: torch.Tensor | None) -> None:
    """The layout `pack_a8_weight` makes for the packed sizes, and the bias."""
    k, n = packed.in_features, packed.out_features
    blocks, groups, quads = -(-n // COLUMNS), packed.scales.shape[1], -(-k // QUAD)
    assert packed.kind in BYTES_PER_QUAD, packed.kind
    assert packed.q.dtype == torch.uint8 and packed.q.is_contiguous()
    assert packed.q.shape == (blocks, quads, BYTES_PER_QUAD[packed.kind]), packed.q.shape
    assert groups == -(-quads // packed.group_quads), (groups, quads, packed.group_quads)
    for t in (packed.scales, packed.offsets):
        assert t.dtype == torch.float32 and t.is_contiguous(), t.dtype
        assert t.shape == (blocks, groups, COLUMNS), (t.shape, blocks, groups)
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.shape == (n,), (bias.dtype, bias.shape)
        assert bias.is_contiguous()
