"""float32 linears whose rows do not depend on their batch: the launcher of cpu_f32_linear.cpp
(built once, like the other CPU kernels, through cpu_build.py).

Why a kernel of our own: a BLAS picks its algorithm from the shape, so the same row multiplied
alone and among other rows can come out different in its last bits (MKL's small-M path on
this project's machines). This kernel sums each output in one fixed order, k = 0..K-1 by fused
multiply-adds from zero, then adds the bias, on every path (AVX-512, AVX2, plain loops): a row's
output is the same bits whatever the call's row count, the row's place in it or the thread
count. The weight is packed in 32-column blocks, [ceil(N/32)][K][32] float32, so a block
streams in the order it is read; each pass takes 256 k of a block against every row tile.

`python -m jobs.bench.linears` times it against torch and oneDNN (BENCHMARKS.md, Kernels).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_build import build_extension

SOURCE = Path(__file__).with_name("cpu_f32_linear.cpp")  # shipped in the wheel beside this file

COLUMNS = 32  # a packed block's columns, kCols in the .cpp


def pack_weight(
    weight: torch.Tensor,  # float32 [N, K]
) -> torch.Tensor:  # float32 [ceil(N / 32), K, 32]
    """Block j, k, column c holds W[32j + c, k]; rows past N are zero."""
    assert weight.dim() == 2 and weight.dtype == torch.float32, (weight.shape, weight.dtype)
    n, k = weight.shape
    blocks = -(-n // COLUMNS)
    padded = F.pad(weight.detach().cpu(), (0, 0, 0, blocks * COLUMNS - n))
    return padded.reshape(blocks, COLUMNS, k).transpose(1, 2).contiguous()


class CpuF32Linear:
    """The compiled kernel. Build with `CpuF32Linear.build()`."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuF32Linear:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(
            build_extension(SOURCE, "batchpage_cpu_f32_linear", "the float32 linear", verbose)
        )

    @property
    def raw(self) -> object:
        """The compiled library: `raw.linear(out, rows, packed, bias)`, unchecked, for a caller
        that checked its shapes once (batchpage/ops/f32_linear.py)."""
        return self._module

    def linear(
        self,
        x: torch.Tensor,  # float32 [..., K]
        packed: torch.Tensor,  # float32 [ceil(N / 32), K, 32], from pack_weight
        bias: torch.Tensor | None,  # float32 [N]
        out_features: int,  # N
    ) -> torch.Tensor:  # float32 [..., N]
        k = x.shape[-1]
        assert x.device.type == "cpu" and x.dtype == torch.float32, (x.device, x.dtype)
        assert packed.dtype == torch.float32 and packed.is_contiguous(), packed.dtype
        assert packed.shape == (-(-out_features // COLUMNS), k, COLUMNS), (packed.shape, k)
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.shape == (out_features,), bias.shape
            assert bias.is_contiguous()
        rows = x.reshape(-1, k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        self._module.linear(out, rows, packed, bias)
        return out.reshape(*x.shape[:-1], out_features)
