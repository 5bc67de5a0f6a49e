"""LinearOp: y = x @ W.T + b, the interface every linear implementation has, and torch's dense
implementation (`Linear`). How a model's linears are made is ops/linear_method.py.

`apply(x, out)` is the call the layers make: x is [T, in] dense in its rows, `out` a [T, out]
Workspace buffer that an implementation able to write into one fills (and returns); one that
cannot returns a tensor of its own. `forward(x)` takes any leading dimensions, for callers
outside the layers (the router of an MoE block, tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearOp(nn.Module):
    """The interface. Implementations hold their weight in their own layout (inference only:
    no autograd) and name its format for the engine's stats (`weight_format`, e.g. "bf16",
    "f32", "q4_1")."""

    in_features: int
    out_features: int
    # A merged [gate | up] linear's module that returns SiLU(gate) * up itself (the activation
    # fused into its kernel): the MLP then skips its own.
    activates: bool = False

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
    """torch's implementation of a dense linear: the weight and bias as loaded, multiplied by
    torch (addmm / mm, the kernels F.linear calls for 2-d inputs)."""

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias, out)

    @property
    def weight_format(self) -> str:
        return dtype_format(self.weight.dtype)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A Linear over these very tensors (shared, not copied)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer
