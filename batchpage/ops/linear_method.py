"""How every linear of a model is made: once, at bind, by the engine's LinearMethod, from the
linear's spec and the tensors its checkpoint loaded (`LinearMethod.create`).

A model is built with a `LinearSpec` per linear (its shape, the projections merged into it, the
checkpoint's quantization scheme, what else its module must do) and loads the checkpoint's
tensors in that spec's form (model/loaded_linear.py). Bind then makes each one's module through
the method, whatever it is: a dense weight on the method's dense implementation (`make`; the
gate/up linear of a SiLU-gated MLP on `silu_mul` where the method fuses the activation), a
quantized one on its integer implementation (`make_int`: the C++ or Triton int kernels, the
layer dequantized once into the engine's dtype, or torch's dequantize-then-multiply). Which
implementation runs each shape is the method's own choice (ops/measured_linear.py measures it);
a tensor-parallel rank's spec is its share, so the same path makes every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from batchpage.ops.linear import LinearOp, dense_linear
from batchpage.ops.quant_linear import QuantLinear
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme


@dataclass(frozen=True)
class LinearSpec:
    """One linear of a model (a tensor-parallel rank's share of it): y = x @ W.T + b with W
    [sum(part_sizes), in_features], the rows of each merged projection in turn. `scheme`: how
    the checkpoint stores W (None: dense, in `dtype`). `silu_gated`: the merged [gate | up]
    linear of a SiLU-gated MLP, whose module may return SiLU(gate) * up itself. `reads_rows`:
    W's rows are read every step as well (a tied head whose table the embedding lookups read):
    its module must give them back cheaply (`LinearOp.weight_rows`)."""

    in_features: int
    part_sizes: tuple[int, ...]
    bias: bool
    dtype: torch.dtype
    scheme: QuantScheme | None = None
    silu_gated: bool = False
    reads_rows: bool = False

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)


class LinearWeights(NamedTuple):
    """A loaded linear's tensors: `dense` [out, in] in the engine's dtype, or `quant` (the
    checkpoint's integer or FP8 codes), and the bias [out] or None."""

    dense: torch.Tensor | None
    quant: IntWeight | None
    bias: torch.Tensor | None


# weight [out, in], bias [out] or None -> the implementation's module for that linear
LinearMaker = Callable[[torch.Tensor, torch.Tensor | None], LinearOp]
# merged [gate | up] weight [2I, in] -> a module whose output is SiLU(x @ gate.T) * (x @ up.T),
# or None where the plain linear and the layer's activation should run instead
SiluMulMaker = Callable[[torch.Tensor], LinearOp | None]
# a quantized linear's IntWeight, bias [out] or None, its scheme -> one implementation's module
IntMaker = Callable[[IntWeight, torch.Tensor | None, "QuantScheme"], LinearOp]


class IntLinearMaker(Protocol):
    """What makes each quantized linear's module. `reads_rows`: as LinearSpec's."""

    def __call__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        reads_rows: bool = False,
    ) -> LinearOp: ...


def torch_int_linear(
    weight: IntWeight, bias: torch.Tensor | None, scheme: QuantScheme, reads_rows: bool = False
) -> LinearOp:
    """torch's implementation of a quantized linear: dequantize on every call, then multiply."""
    return QuantLinear(weight, bias, scheme)


@dataclass(frozen=True)
class LinearMethod:
    """An engine's way of making its linears: `make` for a dense weight (None: torch's, the
    loaded tensors as they are), `silu_mul` where the implementation fuses a SiLU-gated MLP's
    activation into its gate/up linear, `make_int` for a quantized checkpoint's weight (default
    torch's dequantize-then-multiply)."""

    name: str
    make: LinearMaker | None = None
    silu_mul: SiluMulMaker | None = None
    make_int: IntLinearMaker = torch_int_linear
    version: str = ""  # what else identifies it, for cached measurements: a kernel's library
    # Each output row is the same bits whatever other rows the call holds (a fixed summation
    # order, no algorithm picked from the row count): what a batch-invariant engine may bind.
    batch_invariant: bool = False

    def create(self, spec: LinearSpec, weights: LinearWeights) -> LinearOp:
        """The module that runs this linear: the one way every linear of a model is made."""
        dense, quant, bias = weights
        if quant is not None:
            assert spec.scheme is not None and dense is None, spec
            assert (quant.out_features, quant.in_features) == (spec.out_features, spec.in_features)
            return self.make_int(quant, bias, spec.scheme, spec.reads_rows)
        assert dense is not None and dense.shape == (spec.out_features, spec.in_features), spec
        if spec.silu_gated and bias is None and self.silu_mul is not None:
            fused = self.silu_mul(dense)
            if fused is not None:  # else the plain linear wins for this shape
                return fused
        return (self.make or dense_linear)(dense, bias)


@dataclass(frozen=True)
class IntCandidate:
    """One implementation of a quantized checkpoint's linears, a candidate for measured choice
    (ops/measured_linear.py): `takes(weight, scheme)` says whether it computes that layer's
    function (a kernel may need int8 activations, or one group per row), `make` its module."""

    name: str
    make: IntMaker
    takes: Callable[[IntWeight, QuantScheme], bool]
    version: str = ""  # what else identifies it, for cached measurements: a kernel's library
    gives_rows: bool = True  # its weight_rows is cheap enough for every step's lookups
    batch_invariant: bool = False  # as LinearMethod's


# torch's method: dense weights as loaded, quantized ones dequantized on every call.
TORCH_LINEARS = LinearMethod("torch")
# torch's method as one candidate among several for measured choice (ops/measured_linear.py),
# which makes every layer it times.
MEASURABLE_TORCH_LINEARS = LinearMethod("torch", dense_linear)
