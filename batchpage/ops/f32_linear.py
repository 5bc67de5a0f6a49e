"""Linears on the float32 kernel (kernels/cpu_f32_linear.py): a candidate of every float32 CPU
engine's measured choice, and the only dense float32 linear of a batch-invariant one, since each
of its outputs is one fixed-order sum whatever the batch.

The packed weight is a copy in the kernel's layout: bind drops the plain weight, so memory stays
the same. Shapes are checked once, when a layer is made; `apply` calls the compiled kernel
unchecked, with the Workspace buffers the layers hand it (float32, [T, width], dense rows).
"""

from __future__ import annotations

import functools
import warnings

import torch

from batchpage.kernels.cpu_build import KernelBuildError
from batchpage.kernels.cpu_f32_linear import COLUMNS, CpuF32Linear, pack_weight
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import LinearMethod

NAME = "cpu_f32"


class F32KernelLinear(LinearOp):
    """y = x @ W.T + b for float32 x, W packed in 32-column blocks."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuF32Linear
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._run = kernel.raw.linear
        self.register_buffer("packed", pack_weight(weight.detach().float()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        blocks = -(-self.out_features // COLUMNS)
        assert self.packed.shape == (blocks, self.in_features, COLUMNS), self.packed.shape
        assert self.bias is None or self.bias.shape == (self.out_features,)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1, (x.dtype, x.shape)
        assert x.shape[1] == self.in_features and x.device.type == "cpu", x.shape
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._run(out, x, self.packed, self.bias)
        return out

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed[ids // COLUMNS, :, ids % COLUMNS]

    @property
    def weight_format(self) -> str:
        return "f32"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def f32_linears(kernel: CpuF32Linear) -> LinearMethod:
    return LinearMethod(
        NAME,
        functools.partial(F32KernelLinear, kernel=kernel),
        version=getattr(kernel.raw, "__name__", ""),
        batch_invariant=True,
    )


def f32_kernel(dtype: torch.dtype, device: torch.device, required: bool) -> CpuF32Linear | None:
    """The float32 linear kernel where it applies (float32 on a CPU), built here; None
    elsewhere. `required` (linear_backend='cpu_f32', or a batch-invariant float32 engine)
    raises instead, with the reason."""
    if dtype != torch.float32 or device.type != "cpu":
        if required:
            name = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"linear_backend='{NAME}' runs float32 on a CPU; got {name} on {device}: use "
                "linear_backend='auto'"
            )
        return None
    try:
        return CpuF32Linear.build()
    except KernelBuildError as exc:
        if required:
            raise ValueError(f"the float32 linear kernel: {exc}") from exc
        warnings.warn(f"{exc}; float32 linears run on oneDNN or torch", stacklevel=3)
        return None
