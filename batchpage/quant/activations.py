"""Dynamic per-token int8 activations (compressed-tensors' int-quantized W8A8, as vLLM runs
it): each row of x scaled by its own max |x| / 127 and rounded to an integer in [-128, 127]."""

from __future__ import annotations

import torch


def quantize_rows_int8(
    x: torch.Tensor,  # [T, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # values [T, K] in x's dtype (integers), scales f32 [T, 1]
    """x ~= values * scales. Integers up to 128 in magnitude are exact in bf16, so the values
    travel in x's dtype to kernels that take it."""
    xf = x.float()
    scales = xf.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    values = torch.round(xf / scales).clamp_(-128, 127)
    return values.to(x.dtype), scales
