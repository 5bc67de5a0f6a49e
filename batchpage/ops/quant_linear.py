"""QuantLinear: torch's implementation of a quantized linear, on every device and dtype:
dequantize the IntWeight on every call, then multiply. The engine binds it only where no
integer kernel runs and the layer is not dequantized once (ops/select.py): a GPU dtype the
Triton int kernel does not take, or linear_backend="torch"."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchpage.ops.linear import LinearOp
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight

if TYPE_CHECKING:  # the scheme module imports batchpage.model, which imports the ops
    from batchpage.quant.scheme import QuantScheme


class QuantLinear(LinearOp):
    """y = x @ W.T + b with W an IntWeight of `scheme`, held as loaded."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, scheme: QuantScheme) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.weight, self.scheme = weight, scheme
        for name in ("packed", "scales", "offsets", "perm"):  # counted in weight_bytes
            self.register_buffer(name, getattr(weight, name))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        if self.scheme.int8_activations:  # W8A8: int8 rows times int8 weights, then the scales
            values, row_scales = quantize_rows_int8(x)
            dense = weight.dequantize_stored(torch.float32)
            y = F.linear(values.float(), dense) * row_scales
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        dense = weight.dequantize_stored(torch.float32).to(x.dtype)
        return F.linear(x, dense, self.bias)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize_rows(ids)

    @property
    def weight_format(self) -> str:
        return self.scheme.name

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.scheme.name}, group_size={self.weight.group_size}"
        )
