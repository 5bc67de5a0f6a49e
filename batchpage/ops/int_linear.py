"""Integer-weight linears on the C++ int kernels: the CPU implementation of a quantized
checkpoint's linears (their IntWeight, batchpage/quant/int_weight.py) for bfloat16 and float32
activations (a float32 engine keeps its quantized weights packed too).
A scheme with bf16 activations runs on kernels/cpu_int_linear.py (W4A16, W8A16, FP8 weights);
one with int8 activations (W8A8, or any scheme under the engine option int8_activations) on
kernels/cpu_a8_linear.py, each of its vector paths a candidate of its own (AVX512-VNNI where the
CPU has it, "int_a8"; AVX2 on any CPU with AVX2 + FMA, "int_a8_avx2": the int8 path of CPUs
without VNNI), or on the A16 kernel fed the rows' int8 values (exact in bf16 and float32) and
scaled after, or on oneDNN (ops/onednn_int8_linear.py, bf16 rows): the engine measures which is
fastest for each shape (ops/measured_linear.py), so a path that is slower on a CPU (AVX2's on a
VNNI one) is never bound there.

Bind repacks each linear's IntWeight once into its kernel's layout and drops the loaded
form. Shapes are checked once, when a layer is made; `apply` calls the compiled kernel
unchecked with the Workspace buffers the layers hand it (bf16, [T, width], dense rows).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels import cpu_a8_linear, cpu_int_linear
from batchpage.kernels.cpu_a8_linear import CpuA8Linear, pack_a8_weight
from batchpage.kernels.cpu_build import KernelBuildError
from batchpage.kernels.cpu_int_linear import CpuIntLinear, pack_int_weight
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate
from batchpage.ops.onednn_int8_linear import onednn_int8_candidate
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight

if TYPE_CHECKING:  # the scheme module imports batchpage.model, which imports the ops
    from batchpage.quant.scheme import QuantScheme


class _PackedIntLinearOp(LinearOp):
    """An integer W held in one C++ kernel's layout (IntPacked or A8Packed: the same fields) and
    that kernel's unchecked entry point; under act order x's columns are permuted first (one
    index_select: the kernels read the stored order). Subclasses say how x reaches the kernel
    and how a row of W is read back."""

    KERNEL = ""  # the kernel's name in repr

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        packed: cpu_int_linear.IntPacked | cpu_a8_linear.A8Packed,
        kernel: CpuIntLinear | CpuA8Linear,
        run: Callable[..., None],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """`run`: the kernel's unchecked entry (out, x, q, scales, offsets, bias, kind,
        group_quads); `dtype`: the activations' (and outputs') dtype the engine runs."""
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self._format = scheme.name
        self._run = run
        self.kind, self.group_quads = packed.kind, packed.group_quads
        self.register_buffer("q", packed.q)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("offsets", packed.offsets)
        self.register_buffer("perm", weight.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        # The launcher's checks, once: the layout the packing made for these sizes.
        kernel.linear(torch.zeros(1, self.in_features, dtype=dtype), packed, self.bias)

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, K], stored order
        assert x.dtype == self.dtype and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
        assert x.shape[1] == self.in_features, (x.shape, self.in_features)
        return x if self.perm is None else x.index_select(1, self.perm)

    def _call(self, out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._run(out, x, self.q, self.scales, self.offsets, bias, self.kind, self.group_quads)

    def _fields(self) -> tuple:
        return (
            self.q, self.scales, self.offsets, self.kind, self.group_quads, self.in_features,
            self.out_features,
        )  # fmt: skip

    @property
    def weight_format(self) -> str:
        return self._format

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self._format}, {self.KERNEL}"
        )


class CpuIntLinearOp(_PackedIntLinearOp):
    """y = x @ W.T + b for bfloat16 or float32 x (the engine's dtype) and an integer W in the A16
    kernel's layout; under a scheme with int8 activations, x's rows rounded to int8 first (exact
    in either dtype) and scaled after."""

    KERNEL = "C++ int kernel"

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        kernel: CpuIntLinear,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        packed = pack_int_weight(weight)
        super().__init__(weight, bias, scheme, packed, kernel, kernel.raw.linear, dtype)
        self.int8_activations = scheme.int8_activations

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        x = self._inputs(x)
        if self.int8_activations:  # W8A8: the rows' int8 values (exact in bf16), scaled after
            values, row_scales = quantize_rows_int8(x)
            y = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
            self._call(y, values, None)
            y = y.float() * row_scales
            if self.bias is not None:
                y += self.bias
            return y.to(self.dtype)
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        self._call(out, x, self.bias)
        return out

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_int_linear.dequantize_rows(cpu_int_linear.IntPacked(*self._fields()), ids)


class CpuA8LinearOp(_PackedIntLinearOp):
    """y = x @ W.T + b for bfloat16 or float32 x (the engine's dtype), quantized per row to
    int8 in the kernel, and an integer W in the int8-activation kernel's layout, on the path
    `kernel` runs."""

    KERNEL = "C++ int8-activation kernel"

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        kernel: CpuA8Linear,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        assert scheme.int8_activations, scheme
        packed = pack_a8_weight(weight)
        super().__init__(weight, bias, scheme, packed, kernel, kernel.run, dtype)
        self.path = kernel.path

    def extra_repr(self) -> str:
        return f"{super().extra_repr()} ({self.path})"

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        x = self._inputs(x)
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype)
        self._call(out, x, self.bias)
        return out

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_a8_linear.dequantize_rows(cpu_a8_linear.A8Packed(*self._fields()), ids)


def _library(kernel: CpuIntLinear | CpuA8Linear) -> str:
    """A compiled kernel's library name, which changes with its source (cached choices)."""
    return getattr(kernel.raw, "__name__", "")


def _int8_activations(weight: IntWeight, scheme: QuantScheme) -> bool:
    return scheme.int8_activations


def _a16_weights(weight: IntWeight, scheme: QuantScheme) -> bool:
    """The A16 kernel's: every integer scheme, and FP8 e4m3 weights (widened in registers)."""
    return scheme.integer or weight.float8


def cpu_int_candidates(dtype: torch.dtype, device: torch.device) -> list[IntCandidate]:
    """The implementations of a quantized checkpoint's linears that run here, for measured
    choice (ops/measured_linear.py): the A16 int kernel for every integer scheme and FP8 (bfloat16
    activations on a CPU with AVX512-BF16 or AVX2 + FMA; float32 activations on one with AVX2 +
    FMA; built here), and for schemes with int8 activations each vector path of the
    int8-activation kernel that its build has (`a8_candidates`) and, for bfloat16, oneDNN's int8
    matmul (one group per row; AMX-INT8 where the CPU has it). Empty where none runs (a CPU
    without AVX2, a GPU): the quantized linears are then dequantized once, at bind."""
    flags = set(cpu_flags())
    if dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu":
        return []
    wide = {"avx2", "fma"} <= flags
    if not wide and (dtype == torch.float32 or "avx512_bf16" not in flags):
        return []  # the kernel's instructions: its portable build would run, slowly
    try:
        kernel = CpuIntLinear.build()
    except KernelBuildError as exc:
        warnings.warn(f"{exc}; quantized linears dequantize in torch", stacklevel=3)
        return []
    # The compiler must have the instructions the CPU has (else the build is a plain loop).
    if (kernel.wide_path if dtype == torch.float32 else kernel.path) == "plain":
        return []
    a16 = functools.partial(CpuIntLinearOp, kernel=kernel, dtype=dtype)
    found = [IntCandidate("int_a16", a16, _a16_weights, _library(kernel), batch_invariant=True)]
    found += a8_candidates(dtype, flags)
    onednn = onednn_int8_candidate(device) if dtype == torch.bfloat16 else None  # bf16 rows
    return found if onednn is None else [*found, onednn]


# The int8-activation kernel's vector paths as candidates, by name (cached choices keep "int_a8").
A8_NAMES = {"avx512_vnni": "int_a8", "avx2": "int_a8_avx2"}


def a8_candidates(dtype: torch.dtype, flags: set[str]) -> list[IntCandidate]:
    """Each vector path the int8-activation kernel's build has (AVX512-VNNI, AVX2; never its
    plain loop) as a candidate of its own, on a CPU with AVX2 + FMA or AVX512-VNNI, for
    `dtype`'s rows: the measurement, not the flags, decides which runs, so the AVX2 path serves
    CPUs without VNNI and is never bound where VNNI's is faster. Batch-invariant, both: a row's
    int32 sums and their scaling do not depend on the other rows."""
    if not ({"avx2", "fma"} <= flags or "avx512_vnni" in flags):
        return []
    try:
        a8 = CpuA8Linear.build()
    except KernelBuildError as exc:
        warnings.warn(f"{exc}; int8 activations run on the A16 int kernel", stacklevel=4)
        return []
    return [
        IntCandidate(
            A8_NAMES[path],
            functools.partial(CpuA8LinearOp, kernel=a8.with_path(path), dtype=dtype),
            _int8_activations,
            _library(a8),
            batch_invariant=True,
        )
        for path in a8.paths
        if path in A8_NAMES
    ]
