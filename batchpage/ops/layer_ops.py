"""LayerOps: the elementwise parts of a decoder layer, in torch.

Every op takes its outputs first and writes them, so a layer can hand it buffers of the step's
Workspace. The values are HF transformers' (statistics in float32, rounded to the model's dtype
where HF rounds), in any dtype and on any device. Faster implementations subclass this one and
override the ops they serve (compiled_layer_ops.py); an op they do not serve for a given input
falls back to this code, so every implementation computes the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchpage.ops.race import exponential_race


def apply_rope(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # float32 [T, 1, R/2], R = the rotary dimension (<= D)
    sin: torch.Tensor,  # float32 [T, 1, R/2]
) -> torch.Tensor:  # [T, H, D], x's dtype
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) on the first R dimensions, the rest passed
    through; written into one output with four ops (on a CPU each small op costs as much as its
    arithmetic)."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out[..., :half], out[..., half : 2 * half]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    if 2 * half < x.shape[-1]:
        out[..., 2 * half :] = xf[..., 2 * half :]
    return out.to(x.dtype)


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

    def race(
        self,
        probs: torch.Tensor,  # float32 [N, V]
        keys: torch.Tensor,  # int64 [N]: each row's 32-bit draw key (sampler.draw_keys)
    ) -> torch.Tensor:  # int64 [N]: each row's token by the exponential race
        return exponential_race(probs, keys)
