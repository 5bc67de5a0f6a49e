"""LayerOps on the C++ CPU kernels (kernels/cpu_layer_ops.py): one pass over the rows per op on
torch's threads, where torch's code is several small ops, each a dispatch and a wake-up of the
intra-op threads.

The compiled functions are called raw (they check nothing): the layer hands them the step's
Workspace buffers, [T, width] tensors dense in their rows, and weights whose shapes `bind`
checked. Inputs of another form (Qwen3's per-head q/k norms, [T, H, D] views) take the torch
code of the base class, which computes the same values.
"""

from __future__ import annotations

import torch

from batchpage.kernels.cpu_layer_ops import DTYPES, CpuLayerOps
from batchpage.ops.layer_ops import LayerOps


def _rows(x: torch.Tensor) -> bool:
    """Whether the kernels take x: a CPU [N, D] tensor of their dtypes, dense in its rows."""
    return x.dim() == 2 and x.stride(1) == 1 and x.dtype in DTYPES and x.device.type == "cpu"


class CpuKernelLayerOps(LayerOps):
    name = "cpu"

    def __init__(self, kernels: CpuLayerOps) -> None:
        self._raw = kernels.raw

    def rms_norm(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        if not (_rows(x) and out.is_contiguous()):
            return super().rms_norm(out, x, weight, eps)
        self._raw.rms_norm(out, x, weight, eps)

    def add_rms_norm(
        self,
        out: torch.Tensor,
        residual: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        # The kernel reads each element of residual before it writes the sum over it.
        self._raw.add_rms_norm(out, residual, x, residual, weight, eps)

    def silu_mul(self, out: torch.Tensor, gate_up: torch.Tensor) -> None:
        self._raw.silu_mul(out, gate_up)

    def rope_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        n, half = cos.shape[0], cos.shape[-1]
        # [T, 1, R/2] -> [T, R/2]: a view of the rotary tables, which are contiguous.
        self._raw.rope(qk, cos.view(n, half), sin.view(n, half))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if not (_rows(logits) and logits.shape[1] > 0):
            return super().argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        if logits.shape[0]:
            self._raw.argmax_rows(out, logits)
        return out

    def race(self, probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        if not (_rows(probs) and probs.dtype == torch.float32 and probs.shape[1] > 0):
            return super().race(probs, keys)
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        if probs.shape[0]:
            self._raw.race_rows(out, probs, keys.contiguous())
        return out
