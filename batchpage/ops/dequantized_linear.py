"""The one way a quantized weight is dequantized once: at bind, into a dense linear of the
engine's dtype, where the engine is asked to (quantized_weights=False) or no integer kernel
runs here (a CPU without AVX2 + FMA, a compiler that cannot build the kernels).

torch's own path (ops/quant_linear.py) unpacks its whole weight on every call: a dense copy of the
model allocated, faulted in and freed every step, which on a CPU costs far more than the matmuls.
This keeps the dense copy instead (the memory of a checkpoint of that dtype) and multiplies at the
dense kernels' speed, with the same values: W as IntWeight.dequantize gives it. A scheme with int8
activations keeps its rounding (the rows rounded to int8 values, multiplied, scaled after), as
QuantLinear computes it.
"""

from __future__ import annotations

import torch

from batchpage.ops.linear import LinearOp, dense_linear
from batchpage.ops.linear_method import IntLinearMaker, LinearMaker
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme


class DequantizedLinear(LinearOp):
    """A dense weight made from an IntWeight, multiplied by `make`'s module (default: torch's
    Linear); it also gives back its rows (a tied model's embedding lookups read them when the
    checkpoint's only table was quantized)."""

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        rounds_rows: bool,
        make: LinearMaker | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        dense = weight.dequantize(torch.float32).to(dtype)
        bias = None if bias is None else bias.to(dtype)
        self.rounds_rows = rounds_rows  # the scheme's int8 activations: the bias after the scale
        self.inner = (make or dense_linear)(dense, None if rounds_rows else bias)
        self.bias = None if bias is None or not rounds_rows else torch.nn.Parameter(bias, False)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if not self.rounds_rows:
            return self.inner.apply(x, out)
        values, scales = quantize_rows_int8(x)
        y = self.inner.apply(values, None) * scales.to(x.dtype)
        y = y if self.bias is None else y + self.bias
        return y if out is None else out.copy_(y)

    @property
    def weight_format(self) -> str:
        return self.inner.weight_format

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.weight_rows(ids)

    def gives_rows(self) -> bool:
        """Whether its implementation gives its weight's rows back (oneDNN's packed one not)."""
        try:
            self.inner.weight_rows(torch.zeros(1, dtype=torch.long))
        except NotImplementedError:
            return False
        return True


def dequantized_linears(dtype: torch.dtype, make: LinearMaker | None = None) -> IntLinearMaker:
    """The maker bind calls for each quantized linear: its DequantizedLinear in `dtype`, on
    `make`'s implementation (the engine's dense method: each shape's measured choice), or
    torch's where `make` is None or, for a layer whose rows are read, its module cannot give
    them."""

    def maker(
        weight: IntWeight, bias: torch.Tensor | None, scheme: QuantScheme, reads_rows: bool = False
    ) -> LinearOp:
        made = DequantizedLinear(weight, bias, dtype, scheme.int8_activations, make)
        if reads_rows and not made.gives_rows():
            return DequantizedLinear(weight, bias, dtype, scheme.int8_activations)
        return made

    return maker
