"""A quantized checkpoint's linears on the Triton int kernel (kernels/int_matmul.py): a GPU's
(and `linear_backend="triton"`'s), W4A16, W8A16 and FP8 kept as stored, a byte or half a byte
a weight, unpacked in registers. Its rows do not depend on the batch, so a batch-invariant
engine keeps its weights quantized too.
"""

from __future__ import annotations

import functools

import torch

from batchpage.kernels.int_matmul import int_matmul
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme

NAME = "triton_int"


class TritonIntLinear(LinearOp):
    """y = x @ W.T + b for x of the engine's dtype and W an IntWeight in its own layout; under
    act order x's columns are permuted first (the kernel reads the stored order); under a
    scheme with int8 activations, x's rows rounded to int8 first (exact in every dtype the
    kernel takes) and scaled after."""

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.bits, self.group_size, self.fp8 = weight.bits, weight.group_size, weight.float8
        self.storage_bits = weight.storage_bits
        self._format = scheme.name
        self.int8_activations = scheme.int8_activations
        self.register_buffer("codes", weight.packed.detach().contiguous())
        self.register_buffer("scales", weight.scales.detach().float().contiguous())
        self.register_buffer("offsets", weight.offsets.detach().float().contiguous())
        self.register_buffer("perm", weight.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def _weight(self) -> IntWeight:
        return IntWeight(
            self.codes, self.scales, self.offsets, self.bits, self.group_size,
            self.in_features, self.perm, self.fp8,
        )  # fmt: skip

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype == self.dtype and x.dim() == 2 and x.shape[1] == self.in_features
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        args = (self.codes, self.scales, self.offsets, self.storage_bits, self.group_size)
        if self.int8_activations:
            values, row_scales = quantize_rows_int8(x)
            y = int_matmul(values.to(self.dtype), *args, fp8=self.fp8).float() * row_scales
            if self.bias is not None:
                y += self.bias
            y = y.to(self.dtype)
            return y if out is None else out.copy_(y)
        return int_matmul(x, *args, fp8=self.fp8, bias=self.bias, out=out)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._weight().dequantize_rows(ids)

    @property
    def weight_format(self) -> str:
        return self._format

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self._format}, Triton int kernel"
        )


def _any_quantized(weight: IntWeight, scheme: QuantScheme) -> bool:
    return True  # every IntWeight: integer codes of 4 to 8 bits, or FP8


def triton_int_candidates(dtype: torch.dtype) -> list[IntCandidate]:
    """The Triton int kernel as the one implementation of a quantized layer (a GPU's)."""
    make = functools.partial(TritonIntLinear, dtype=dtype)
    return [IntCandidate(NAME, make, _any_quantized, batch_invariant=True)]
