"""bf16 linears for CPUs with AVX512-BF16: the launcher of cpu_bf16_linear.cpp (built once,
like the other CPU kernels, through cpu_build.py).

Why not oneDNN: a decode step multiplies a few to a few hundred rows against weights that are
never in the caches (between two uses of a layer's weight the step reads every other weight of
the model), and there oneDNN's packed bf16 linears run well below their rate with the same
weight hot. This kernel streams each weight once, in the order it is
stored: the weight is packed as bf16 pairs in 32-column blocks, [ceil(N/32)][ceil(K/2)][32]
int32, so one k-pair of a block is two 64-byte loads and a row of x meets it through one
32-bit broadcast and two vdpbf16ps (an 8-row x 32-column tile: 16 float32 accumulators). The
blocks are split over torch's threads. Measured against oneDNN: `python -m jobs.bench.linears`
(BENCHMARKS.md, Kernels).

A merged [gate | up] weight can be packed gated (`pack_gated_weight`): each block then holds 16
gate columns and the 16 up columns of the same indices, and `silu_mul_linear` writes
SiLU(gate) * up straight from the accumulators, equal bit for bit to the linear followed by
cpu_layer_ops's silu_mul, without writing the [T, 2I] product and reading it back.

Without AVX512-BF16 the library builds a plain float32 loop over the same layout (`native` is
then False): the engine never picks it, the tests use it to check the layout on any CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_build import build_extension

SOURCE = Path(__file__).with_name("cpu_bf16_linear.cpp")  # shipped in the wheel beside this file

COLUMNS = 32  # a packed block's columns, kCols in the .cpp


def pack_weight(
    weight: torch.Tensor,  # bf16 [N, K]
) -> torch.Tensor:  # int32 [ceil(N / 32), ceil(K / 2), 32]
    """The layout the kernel reads: block j, pair p, column c holds W[32j + c, 2p] in its low and
    W[32j + c, 2p + 1] in its high 16 bits; rows past N and the column past an odd K are zero."""
    assert weight.dim() == 2 and weight.dtype == torch.bfloat16, (weight.shape, weight.dtype)
    n, k = weight.shape
    blocks, pairs = -(-n // COLUMNS), -(-k // 2)
    padded = F.pad(weight.detach().cpu(), (0, 2 * pairs - k, 0, blocks * COLUMNS - n))
    # [NB, 32, KP, 2] -> [NB, KP, 32, 2]; a pair's two bf16 are one little-endian int32
    pairs_first = padded.reshape(blocks, COLUMNS, pairs, 2).transpose(1, 2).contiguous()
    return pairs_first.view(torch.int32).reshape(blocks, pairs, COLUMNS)


def pack_gated_weight(
    weight: torch.Tensor,  # bf16 [2I, K]: gate rows [0, I), up rows [I, 2I)
) -> torch.Tensor:  # int32 [ceil(I / 16), ceil(K / 2), 32]
    """pack_weight of the rows reordered so that block j holds gate rows 16j..16j+15 in its
    first 16 columns and the same up rows in its last 16 (zero rows past I)."""
    assert weight.dim() == 2 and weight.shape[0] % 2 == 0, weight.shape
    inter, half = weight.shape[0] // 2, COLUMNS // 2
    blocks = -(-inter // half)
    gate, up = (F.pad(w, (0, 0, 0, blocks * half - inter)) for w in weight.split(inter))
    paired = torch.stack([gate.reshape(blocks, half, -1), up.reshape(blocks, half, -1)], dim=1)
    return pack_weight(paired.reshape(blocks * COLUMNS, -1))


class CpuBf16Linear:
    """The compiled kernel. Build with `CpuBf16Linear.build()`."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuBf16Linear:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(build_extension(SOURCE, "batchpage_cpu_bf16_linear", "the bf16 linear", verbose))

    @property
    def native(self) -> bool:
        """Whether this build runs on AVX512-BF16 (else: the plain loop, for tests)."""
        return bool(self._module.native())

    @property
    def raw(self) -> object:
        """The compiled library: `raw.linear(out, rows, packed, bias, gated)` as `_run` calls it,
        unchecked, for a caller that checked its shapes once (batchpage/ops/bf16_linear.py)."""
        return self._module

    def linear(
        self,
        x: torch.Tensor,  # bf16 [..., K], rows dense in their last dimension
        packed: torch.Tensor,  # int32 [ceil(N / 32), ceil(K / 2), 32], from pack_weight
        bias: torch.Tensor | None,  # float32 [N]
        out_features: int,  # N
    ) -> torch.Tensor:  # bf16 [..., N]
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.shape == (out_features,), bias.shape
            assert bias.is_contiguous()
        return self._run(x, packed, bias, out_features, gated=False)

    def silu_mul_linear(
        self,
        x: torch.Tensor,  # bf16 [..., K], rows dense in their last dimension
        packed: torch.Tensor,  # int32 [ceil(I / 16), ceil(K / 2), 32], from pack_gated_weight
        intermediate: int,  # I
    ) -> torch.Tensor:  # bf16 [..., I]: SiLU(x @ gate.T) * (x @ up.T), rounded as silu_mul
        return self._run(x, packed, None, intermediate, gated=True)

    def _run(
        self,
        x: torch.Tensor,  # bf16 [..., K]
        packed: torch.Tensor,  # int32 [blocks, ceil(K / 2), 32]
        bias: torch.Tensor | None,  # float32 [N], checked by the caller
        columns: int,  # the output's: N, or I when gated
        gated: bool,
    ) -> torch.Tensor:  # bf16 [..., columns]
        k = x.shape[-1]
        assert x.device.type == "cpu" and x.dtype == torch.bfloat16, (x.device, x.dtype)
        assert packed.dtype == torch.int32 and packed.is_contiguous(), packed.dtype
        per_block = COLUMNS // 2 if gated else COLUMNS  # a gated block: 16 gate + 16 up columns
        blocks = -(-columns // per_block)
        assert packed.shape == (blocks, -(-k // 2), COLUMNS), (packed.shape, columns, k, gated)
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], columns, dtype=torch.bfloat16)
        self._module.linear(out, rows, packed, bias, gated)
        return out.reshape(*x.shape[:-1], columns)
