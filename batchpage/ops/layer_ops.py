"""LayerOps: the elementwise parts of a decoder layer, in torch.

Every op takes its outputs first and writes them, so a layer can hand it buffers of the step's
Workspace. The values are HF transformers' (statistics in float32, rounded to the model's dtype
where HF rounds), in any dtype and on any device. Faster implementations subclass this one and
override the ops they serve (cpu_layer_ops.py); an op they do not serve for a given input falls
back to this code, so every implementation computes the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchpage.model.rope import apply_rope


class LayerOps:
    """The torch implementation. Stateless: one instance may serve every layer of a model."""

    name = "torch"

    def rms_norm(
        self,
        out: torch.Tensor,  # [..., D], x's dtype
        x: torch.Tensor,  # [..., D]
        weight: torch.Tensor,  # [D], x's dtype
        eps: float,
    ) -> None:
        """out = weight * T(x * rsqrt(mean(x^2) + eps)), T the rounding to x's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        torch.mul(weight, xf.to(x.dtype), out=out)

    def add_rms_norm(
        self,
        out: torch.Tensor,  # [T, D]
        residual: torch.Tensor,  # [T, D], updated in place
        x: torch.Tensor,  # [T, D]
        weight: torch.Tensor,  # [D]
        eps: float,
    ) -> None:
        """residual += x (in the residual's dtype), then out = rms_norm(residual). `out` must
        not alias x or residual."""
        residual.add_(x)
        self.rms_norm(out, residual, weight, eps)

    def silu_mul(
        self,
        out: torch.Tensor,  # [T, I]
        gate_up: torch.Tensor,  # [T, 2I]: gate in columns [0, I), up in [I, 2I)
    ) -> None:
        gate, up = gate_up.split(out.shape[-1], dim=-1)
        torch.mul(F.silu(gate), up, out=out)

    def rope_(
        self,
        qk: torch.Tensor,  # [T, H, D], heads dense; rotated in place
        cos: torch.Tensor,  # float32 [T, 1, R/2], R the rotary dimension (<= D)
        sin: torch.Tensor,  # float32 [T, 1, R/2]
    ) -> None:
        qk.copy_(apply_rope(qk, cos, sin))

    def argmax(
        self,
        logits: torch.Tensor,  # [N, V], any float dtype
    ) -> torch.Tensor:  # int64 [N]: the first maximum of each row (a NaN's, if it has one)
        return logits.argmax(dim=-1)
