"""LayerOps whose norms run on the one-program-per-row Triton kernel (kernels/rms_norm.py): a
batch-invariant Triton engine's (a GPU's), where torch's row reductions may split a row
differently with the number of rows. The activation and the rotary embedding are elementwise,
so torch's code is invariant already, and a row's argmax is exact in any order."""

from __future__ import annotations

import torch

from batchpage.kernels.rms_norm import rms_norm
from batchpage.ops.layer_ops import LayerOps


class TritonLayerOps(LayerOps):
    name = "triton"

    def rms_norm(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        rms_norm(out, x, weight, eps)

    def add_rms_norm(
        self,
        out: torch.Tensor,
        residual: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        rms_norm(out, x, weight, eps, residual=residual)
