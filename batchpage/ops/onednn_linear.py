"""Linears with weights prepacked for oneDNN, the CPU path of the engine's matmuls where the bf16
kernel does not apply (float32; bf16 without AVX512-BF16).

`F.linear` on a CPU hands a plain row-major weight to the BLAS on every call, and a decode
step's matmuls have few rows (one per running sequence), where that call runs well below the
machine's matmul rate. oneDNN reorders the weight once into its blocked layout
(`mkldnn._reorder_linear_weight`) and multiplies against it (`mkldnn._linear_pointwise`).
Results differ from `F.linear` only by summation order. BENCHMARKS.md, "Kernels", has the
measurements.
"""

from __future__ import annotations

import torch

from batchpage.ops.linear import LinearOp, dtype_format
from batchpage.ops.linear_method import LinearMethod


class OneDnnLinear(LinearOp):
    """y = x @ W.T + b with W in oneDNN's blocked layout. oneDNN allocates its output, so
    `apply` returns a tensor of its own."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._format = dtype_format(weight.dtype)
        # The batch-size hint is left to oneDNN, which measured fastest across 1..512 rows.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight_format(self) -> str:
        return self._format

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


ONEDNN_LINEARS = LinearMethod("onednn", OneDnnLinear)


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack and multiply `dtype` weights here: a CPU torch built with oneDNN,
    and for bfloat16 a CPU with the instructions oneDNN's bf16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); found by packing a tiny weight, which raises where it cannot."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = OneDnnLinear(torch.ones(8, 8, dtype=dtype), None)
        layer(torch.ones(2, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True
