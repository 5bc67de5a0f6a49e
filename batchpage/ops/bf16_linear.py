"""Linears on the AVX512-BF16 kernel (kernels/cpu_bf16_linear.py), the CPU path of bfloat16
matmuls where the CPU has AVX512-BF16.

A decode step multiplies a few rows against weights that are never in the caches; the kernel
streams each weight once in its packed order, where oneDNN's packed bf16 linears run further
below the machine's rate (BENCHMARKS.md, "Kernels"). The packed weight is a copy in the
kernel's layout: bind drops the plain weight, so memory stays the same, except for a tied
lm_head, whose embedding keeps its plain table for lookups.

Shapes are checked once, when a layer is made; `apply` calls the compiled kernel unchecked,
with the Workspace buffers the layers hand it (bf16, [T, width], dense rows).
"""

from __future__ import annotations

import functools
import warnings

import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_bf16_linear import (
    COLUMNS,
    CpuBf16Linear,
    pack_gated_weight,
    pack_weight,
)
from batchpage.kernels.cpu_build import KernelBuildError
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import LinearMethod


def _checked_rows(x: torch.Tensor, in_features: int) -> None:
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
    assert x.shape[1] == in_features and x.device.type == "cpu", (x.shape, in_features)


class Bf16DotLinear(LinearOp):
    """y = x @ W.T + b for bfloat16 x, W packed in k-pairs for vdpbf16ps. The bias is kept in
    float32, where the kernel adds it before rounding the sum to bf16 once."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuBf16Linear
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._run = kernel.raw.linear
        self.register_buffer("packed", pack_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        blocks, pairs = -(-self.out_features // COLUMNS), -(-self.in_features // 2)
        assert self.packed.shape == (blocks, pairs, COLUMNS), self.packed.shape
        assert self.bias is None or self.bias.shape == (self.out_features,)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        _checked_rows(x, self.in_features)
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        self._run(out, x, self.packed, self.bias, False)
        return out

    @property
    def weight_format(self) -> str:
        return "bf16"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, AVX512-BF16"


class Bf16SiluMulLinear(LinearOp):
    """SiLU(x @ gate.T) * (x @ up.T) for bfloat16 x from a merged [gate | up] weight without a
    bias, the activation in the kernel's epilogue: the same values as Bf16DotLinear followed by
    the C++ silu_mul, without the [T, 2I] product written and read back."""

    activates = True

    def __init__(self, weight: torch.Tensor, kernel: CpuBf16Linear) -> None:
        super().__init__()
        assert weight.shape[0] % 2 == 0, weight.shape
        self.out_features, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self._run = kernel.raw.linear
        self.register_buffer("packed", pack_gated_weight(weight.detach()))
        blocks, pairs = -(-self.out_features // (COLUMNS // 2)), -(-self.in_features // 2)
        assert self.packed.shape == (blocks, pairs, COLUMNS), self.packed.shape

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        _checked_rows(x, self.in_features)
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        self._run(out, x, self.packed, None, True)
        return out

    @property
    def weight_format(self) -> str:
        return "bf16"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, intermediate={self.out_features}, SiLU(gate) * up"


def bf16_linears(kernel: CpuBf16Linear) -> LinearMethod:
    return LinearMethod(
        "avx512_bf16",
        functools.partial(Bf16DotLinear, kernel=kernel),
        functools.partial(Bf16SiluMulLinear, kernel=kernel),
        version=getattr(kernel.raw, "__name__", ""),
        batch_invariant=True,  # each output is one k-ordered sum, whatever the rows
    )


def bf16_dot_kernel(
    dtype: torch.dtype, device: torch.device, required: bool
) -> CpuBf16Linear | None:
    """The bf16 linear kernel where it applies: bfloat16 on a CPU with AVX512-BF16, built here.
    None elsewhere; `required` (linear_backend='avx512_bf16') raises instead, with the reason."""
    name = str(dtype).removeprefix("torch.")
    if dtype != torch.bfloat16 or device.type != "cpu" or "avx512_bf16" not in cpu_flags():
        if required:
            raise ValueError(
                f"linear_backend='avx512_bf16' needs bfloat16 on a CPU with AVX512-BF16 (an "
                f"avx512_bf16 flag in /proc/cpuinfo); got {name} on {device}: use "
                "linear_backend='auto'"
            )
        return None
    try:
        kernel = CpuBf16Linear.build()
    except KernelBuildError as exc:
        if required:
            raise ValueError(f"linear_backend='avx512_bf16': {exc}") from exc
        warnings.warn(f"{exc}; the linears fall back to oneDNN, or torch", stacklevel=3)
        return None
    if not kernel.native:  # the compiler lacks the instructions the CPU has
        if required:
            raise ValueError(
                "linear_backend='avx512_bf16': the compiler built the bf16 linear without "
                "AVX512-BF16 (it needs g++ 10 or later); use linear_backend='auto'"
            )
        return None
    return kernel
