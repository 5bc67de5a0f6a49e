"""Linears with weights prepacked for oneDNN, the CPU path of the engine's matmuls.

`F.linear` on a CPU hands a plain row-major weight to the BLAS on every call, and a decode
step's matmuls have few rows (one per running sequence), where that call ran well below the
machine's matmul rate (the lm_head at 25-50 GFLOP/s at 16-64 rows, against 65-112 for oneDNN).
oneDNN reorders the weight once into its blocked layout (`mkldnn._reorder_linear_weight`) and
multiplies against it (`mkldnn._linear_pointwise`). Measured on a 2-core AMD EPYC (AVX2,
float32, SmolLM2-135M's shapes; BENCHMARKS.md, "Prepacked linears"): the 49152-row lm_head
runs 1.3-2.6x faster at every row count from 1 to 512, a layer's linears 1.45x at 16 rows,
1.1x at 64-256 and even at 512; at a single row the small ones are slower (0.7-0.8x), the
lm_head still 1.7x faster.

On a CPU with AVX512-BF16, bfloat16 weights go to batchpage's own kernel instead
(kernels/cpu_bf16_linear.py, `Bf16DotLinear`): with weights streaming from memory, as in a
decode step, a layer's linears ran 1.4x faster than oneDNN's packed bf16 ones at 1 row, 1.1-1.3x
at 16-256 rows and level at 512, the lm_head level from 16 rows up, on a Zen 4 EPYC
(BENCHMARKS.md, "CPU throughput after the bf16 linear kernel").

The packed weight is a copy in an opaque layout: `pack_linear_modules` (called by
`CausalLM.prepack_linears`) swaps each `nn.Linear` of a loaded model for a `PackedLinear` (or a
`Bf16DotLinear`), dropping the plain weight, so memory stays the same. The one exception is a
tied lm_head: the embedding keeps its plain table for lookups and the packed copy is extra
(vocab x hidden elements). Results differ from `F.linear` only by summation order (measured:
about 5e-6 at outputs of order 1 in float32; in bf16, identical logits on every tested family).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_bf16_linear import CpuBf16Linear, pack_gated_weight, pack_weight
from batchpage.kernels.cpu_build import KernelBuildError

LINEAR_BACKENDS = ("auto", "avx512_bf16", "onednn", "torch")

# weight [out, in], bias [out] or None -> the module that replaces an nn.Linear
Packer = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
# merged [gate | up] weight [2I, in] -> a module computing SiLU(x @ gate.T) * (x @ up.T)
SiluMulPacker = Callable[[torch.Tensor], nn.Module]


@dataclass(frozen=True)
class LinearPacking:
    """How CausalLM.prepack_linears replaces a model's linears: `linear` makes the module for
    every nn.Linear; where the backend fuses it, `silu_mul` makes the one for a SiLU GatedMLP's
    merged gate/up linear, which then returns the activation itself."""

    linear: Packer
    silu_mul: SiluMulPacker | None = None


@dataclass(frozen=True)
class PackReport:
    """What prepack_linears did: how many linears it packed and the extra bytes it kept (a tied
    lm_head's packed copy)."""

    packed: int
    extra_bytes: int


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout. Inference only (no autograd)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # [out, in] in oneDNN's layout; the batch-size hint is left to oneDNN, which measured
        # fastest across 1..512 rows.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


class Bf16DotLinear(nn.Module):
    """y = x @ W.T + b for bfloat16 x, W packed in k-pairs for AVX512-BF16's vdpbf16ps
    (kernels/cpu_bf16_linear.py). Inference only. The bias is kept in float32, where the kernel
    adds it before rounding the sum to bf16 once."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuBf16Linear
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.register_buffer("packed", pack_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # bf16 [..., in] -> [..., out]
        return self.kernel.linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, AVX512-BF16"


class Bf16SiluMulLinear(nn.Module):
    """SiLU(x @ gate.T) * (x @ up.T) for bfloat16 x from a merged [gate | up] weight without a
    bias, the activation in the kernel's epilogue (kernels/cpu_bf16_linear.py,
    `silu_mul_linear`): the same values as Bf16DotLinear followed by the C++ silu_mul, without
    the [T, 2I] product written and read back. Inference only."""

    def __init__(self, weight: torch.Tensor, kernel: CpuBf16Linear) -> None:
        super().__init__()
        assert weight.shape[0] % 2 == 0, weight.shape
        self.intermediate, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self.kernel = kernel
        self.register_buffer("packed", pack_gated_weight(weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # bf16 [..., in] -> [..., I]
        return self.kernel.silu_mul_linear(x, self.packed, self.intermediate)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, intermediate={self.intermediate}, SiLU(gate) * up"


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
        warnings.warn(f"{exc}; the linears fall back to oneDNN, or F.linear", stacklevel=3)
        return None
    if not kernel.native:  # the compiler lacks the instructions the CPU has
        if required:
            raise ValueError(
                "linear_backend='avx512_bf16': the compiler built the bf16 linear without "
                "AVX512-BF16 (it needs g++ 10 or later); use linear_backend='auto'"
            )
        return None
    return kernel


ONEDNN_PACKING = LinearPacking(PackedLinear)


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack and multiply `dtype` weights here: a CPU torch built with oneDNN,
    and for bfloat16 a CPU with the instructions oneDNN's bf16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); found by packing a tiny weight, which raises where it cannot."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = PackedLinear(torch.ones(8, 8, dtype=dtype), None)
        layer(torch.ones(2, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_linear_modules(model: nn.Module, packer: Packer = PackedLinear) -> int:
    """Replace every nn.Linear under `model` by `packer(weight, bias)` in place; returns how
    many. Call after the weights are loaded: the plain weights are gone afterwards."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, packer(module.weight, module.bias))
    return len(linears)


def linear_packing(choice: str, dtype: torch.dtype, device: torch.device) -> LinearPacking | None:
    """The engine's `linear_backend`, as the modules the linears become (None: keep F.linear).
    "avx512_bf16" is Bf16DotLinear (with SiLU(gate) * up fused into the gate/up linear) or
    raises; "onednn" is PackedLinear or raises; "torch" is F.linear; "auto" takes the first that
    applies: the bf16 kernel (bf16 on AVX512-BF16), PackedLinear (wherever oneDNN packs this
    dtype on a CPU), F.linear."""
    if choice not in LINEAR_BACKENDS:
        allowed = ", ".join(LINEAR_BACKENDS)
        raise ValueError(f"linear_backend must be one of {allowed}; got {choice!r}")
    if choice == "torch":
        return None
    if choice in ("auto", "avx512_bf16"):
        kernel = bf16_dot_kernel(dtype, device, required=choice == "avx512_bf16")
        if kernel is not None:
            return LinearPacking(
                functools.partial(Bf16DotLinear, kernel=kernel),
                functools.partial(Bf16SiluMulLinear, kernel=kernel),
            )
    packs = onednn_packs(dtype, device)
    if choice == "onednn" and not packs:
        raise ValueError(
            f"linear_backend='onednn' cannot pack {str(dtype).removeprefix('torch.')} weights on "
            f"{device}: it needs a CPU torch built with oneDNN, and for bfloat16 a CPU with "
            "AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; use linear_backend='auto' or 'torch'"
        )
    return ONEDNN_PACKING if packs else None
