"""Linears on the batch-invariant Triton matmul (kernels/invariant_matmul.py): a GPU's dense
linears when EngineConfig.batch_invariant is on, and `linear_backend="triton"` anywhere Triton
runs (on a CPU only under its interpreter: tests).

The weight stays as loaded ([out, in], the engine's dtype); a quantized checkpoint's weights run
on the Triton int kernel (ops/triton_int_linear.py), whose tiles are fixed too: cuBLAS, which
torch's dequantize-then-multiply runs on, picks its algorithm from the row count.
"""

from __future__ import annotations

import torch

from batchpage.kernels.invariant_matmul import invariant_matmul
from batchpage.ops.linear import LinearOp, dtype_format
from batchpage.ops.linear_method import LinearMethod

NAME = "triton"


class TritonLinear(LinearOp):
    """y = x @ W.T + b, each output one fixed-order sum whatever the batch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.detach().to(weight.dtype).contiguous(), False)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return invariant_matmul(x, self.weight, self.bias, out)

    @property
    def weight_format(self) -> str:
        return dtype_format(self.weight.dtype)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids].float()


TRITON_LINEARS = LinearMethod(NAME, TritonLinear, batch_invariant=True)
