"""LinearOp: y = x @ W.T + b, the interface every linear implementation has, and LinearMethod,
how `CausalLM.bind` turns a loaded dense linear into an implementation's module.

`apply(x, out)` is the call the layers make: x is [T, in] dense in its rows, `out` a [T, out]
Workspace buffer that an implementation able to write into one fills (and returns); one that
cannot returns a tensor of its own. `forward(x)` takes any leading dimensions, for callers
outside the layers (the router of an MoE block, tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from batchpage.quant.int_weight import IntWeight
    from batchpage.quant.scheme import QuantScheme


class LinearOp(nn.Module):
    """The interface. Implementations hold their weight in their own layout (inference only:
    no autograd) and name its format for the engine's stats (`weight_format`, e.g. "bf16",
    "f32", "q4_1")."""

    in_features: int
    out_features: int

    def apply(
        self,
        x: torch.Tensor,  # [T, in], dense in its rows
        out: torch.Tensor | None,  # [T, out], contiguous, or None
    ) -> torch.Tensor:  # [T, out]: `out` where the implementation writes into it
        raise NotImplementedError

    @property
    def weight_format(self) -> str:
        raise NotImplementedError

    def weight_rows(
        self,
        ids: torch.Tensor,  # int64 [R], output rows
    ) -> torch.Tensor:  # float32 [R, in]: W[ids], dequantized where W is held quantized
        """Rows of the weight: for a tied model whose head holds the only copy of its embedding
        table (a GGUF's quantized token_embd), lookups read it here; a classifier made of an
        lm_head's rows (classifier_from_token) takes them here, whatever the head's format."""
        raise NotImplementedError(f"{type(self).__name__} does not give back its weight's rows")

    def weight_bytes(self) -> int:
        """Bytes of weight (and bias) this layer holds."""
        return sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self.apply(rows, None).reshape(*x.shape[:-1], self.out_features)


def dtype_format(dtype: torch.dtype) -> str:
    """A dense weight's format name: "f32", "bf16", "f16"."""
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def dense_matmul(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None,  # [out]
    out: torch.Tensor | None,  # [T, out] or None
) -> torch.Tensor:
    """x @ weight.T + bias, into `out` where given (the kernels F.linear calls for 2-d x)."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Linear(nn.Linear, LinearOp):
    """The dense linear the models are built with: checkpoint tensors load into its `weight`
    and `bias`, and torch multiplies (addmm / mm, the kernels F.linear calls for 2-d inputs),
    which is the torch method's implementation too."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias, out)

    @property
    def weight_format(self) -> str:
        return dtype_format(self.weight.dtype)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# weight [out, in], bias [out] or None -> the implementation's module for that linear
LinearMaker = Callable[[torch.Tensor, torch.Tensor | None], LinearOp]
# merged [gate | up] weight [2I, in] -> a module whose output is SiLU(x @ gate.T) * (x @ up.T),
# or None where the plain linear and the layer's activation should run instead
SiluMulMaker = Callable[[torch.Tensor], LinearOp | None]
# a quantized linear's IntWeight, bias [out] or None, its scheme -> one implementation's module
IntMaker = Callable[["IntWeight", torch.Tensor | None, "QuantScheme"], LinearOp]


class IntLinearMaker(Protocol):
    """What bind calls for each quantized linear: its module. `reads_rows`: the layer's rows
    are read as well, every step (a tied head whose table the lookups read): the module must
    give them back cheaply (weight_rows)."""

    def __call__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        reads_rows: bool = False,
    ) -> LinearOp: ...


@dataclass(frozen=True)
class LinearMethod:
    """How bind turns each dense `Linear` of a loaded model into this implementation's module.
    `make` None keeps the dense Linear (torch's method); `silu_mul`, where the implementation
    fuses it, makes the module for a SiLU-gated MLP's merged gate/up linear, which then returns
    the activation itself. `make_int` makes the module for a quantized checkpoint's linear
    (batchpage/quant's QuantLinear) from its IntWeight; None keeps the QuantLinear, which
    dequantizes in torch."""

    name: str
    make: LinearMaker | None = None
    silu_mul: SiluMulMaker | None = None
    make_int: IntLinearMaker | None = None
    version: str = ""  # what else identifies it, for cached measurements: a kernel's library
    # Each output row is the same bits whatever other rows the call holds (a fixed summation
    # order, no algorithm picked from the row count): what a batch-invariant engine may bind.
    batch_invariant: bool = False


TORCH_LINEARS = LinearMethod("torch")


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A Linear over these very tensors (shared, not copied)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer


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


# torch's method as one candidate among several for measured choice (ops/measured_linear.py),
# which makes every layer it times.
MEASURABLE_TORCH_LINEARS = LinearMethod("torch", dense_linear)
