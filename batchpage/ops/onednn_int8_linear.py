"""Integer-weight linears with int8 activations on oneDNN's quantized matmul: a candidate for a
per-channel scheme with int8 activations (W8A8, W4A8 with one group per output row), beside
batchpage's own VNNI kernel (kernels/cpu_a8_linear.py).

Why oneDNN too: it multiplies int8 on AMX-INT8 tiles where the CPU has them, and with VNNI
elsewhere; which of it and the VNNI kernel is faster depends on the CPU and the row count, so
the engine measures both at bind (ops/measured_linear.py).

The function is the one the VNNI kernel computes: each row of x rounded to int8 with its own
scale (batchpage.quant.activations.quantize_rows_int8), multiplied exactly in int32, scaled in
float32. oneDNN takes unsigned activations with a zero point and signed weights without one, so
x travels as xq + 128 (zero point 128) and W's stored q as q' = q - 2^(bits-1) (int8 for any
width up to 8 bits); the offset that shift moves, offsets + 2^(bits-1) * scales, is a rank-one
term added after, from each row's int8 sum:

    y = xs * (s * (xq @ q'.T) + rowsum(xq) * (offsets + 2^(bits-1) * s)) + b
"""

from __future__ import annotations

import torch

from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme

ZERO_POINT = 128  # xq in [-128, 127] travels as xq + 128 in a byte


class OneDnnInt8Linear(LinearOp):
    """y = x @ W.T + b for bfloat16 x (rounded per row to int8) and a one-group integer W held
    in oneDNN's packed int8 layout. Bias and the rank-one term stay in float32."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None, scheme: QuantScheme) -> None:
        super().__init__()
        assert takes(weight, scheme), (weight.num_groups, scheme)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self._format = scheme.name
        center = 1 << (weight.bits - 1)
        signed = (weight.values() - center).to(torch.int8)
        self.register_buffer("packed", torch.ops.onednn.qlinear_prepack(signed, None))
        self.register_buffer("scales", weight.scales[:, 0].contiguous())
        shift = weight.offsets[:, 0] + center * weight.scales[:, 0]
        self.register_buffer("shift", shift if bool(shift.any()) else None)
        self.register_buffer("zeros", torch.zeros(self.out_features, dtype=torch.int64))
        self.register_buffer("perm", weight.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def _products(self, xu: torch.Tensor) -> torch.Tensor:  # uint8 [T, K] -> f32 [T, N]
        """s * ((xu - 128) @ q'.T) on oneDNN."""
        return torch.ops.onednn.qlinear_pointwise(
            xu, 1.0, ZERO_POINT, self.packed, self.scales, self.zeros, None, 1.0, 0,
            torch.float32, "none", [], "",
        )  # fmt: skip

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == self.in_features
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        values, row_scales = quantize_rows_int8(x)
        y = self._products((values.float() + ZERO_POINT).to(torch.uint8))
        if self.shift is not None:
            y.addmm_(values.float().sum(1, keepdim=True), self.shift[None, :])
        y.mul_(row_scales)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(torch.bfloat16) if out is None else out.copy_(y)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] read back through the matmul (oneDNN's layout has no unpacking): unit rows
        give W's columns, a chunk of inputs at a time. A setup-time call (a classifier made of
        head rows), not a per-step one."""
        k = self.in_features
        stored = torch.empty(len(ids), k, dtype=torch.float32)
        for start in range(0, k, 1024):
            width = min(1024, k - start)
            units = torch.full((width, k), ZERO_POINT, dtype=torch.uint8)
            units[torch.arange(width), torch.arange(start, start + width)] += 1
            stored[:, start : start + width] = self._products(units)[:, ids].T
        if self.shift is not None:
            stored += self.shift[ids, None]
        if self.perm is None:
            return stored
        dense = torch.empty_like(stored)
        dense[:, self.perm] = stored
        return dense

    @property
    def weight_format(self) -> str:
        return self._format

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self._format}, oneDNN int8"
        )


def takes(weight: IntWeight, scheme: QuantScheme) -> bool:
    """Whether a layer is this implementation's: int8 activations, integer values, and one
    scale and offset per output row (a per-channel scheme; a grouped one would need a scale per
    group inside the sum)."""
    return scheme.int8_activations and scheme.integer and weight.num_groups == 1


def onednn_int8_candidate(device: torch.device) -> IntCandidate | None:
    """The candidate where this torch's oneDNN runs quantized linears on this CPU, exactly
    (found by multiplying a tiny weight, which raises where it cannot); None elsewhere. Without
    VNNI or AMX (an AVX2 CPU) oneDNN sums byte pairs with vpmaddubsw, whose int16 sums saturate
    at 2^15 - 1: 255 * 127 twice, as xq = 127 (255 with the zero point) against q' = 127, is
    not its int8 product there, so the probe multiplies that too (the int8-activation kernel's
    AVX2 path is the exact one there)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    from batchpage.quant.scheme import QuantScheme

    scheme = QuantScheme("compressed-tensors", 8, None, True, False, int8_activations=True)
    q = torch.full((8, 8), 130, dtype=torch.uint8)  # W = 2, and in the second row W = 127
    q[1] = 255
    weight = IntWeight(q, torch.ones(8, 1), torch.full((8, 1), -128.0), 8, 8, 8)
    try:
        layer = OneDnnInt8Linear(weight, None, scheme)
        got = layer.apply(torch.ones(2, 8, dtype=torch.bfloat16), None).float()
    except RuntimeError:
        return None
    # 8 inputs of 1 (xq = 127, scale 1 / 127) times W = 2: 16; times W = 127: 1016 (in bf16)
    want = torch.tensor([16.0, 1016.0, *[16.0] * 6])
    if not torch.equal(got, want.expand(2, 8)):  # a build that miscomputes, or saturates
        return None
    # Its rows come back through a matmul over every input: never for a tied head's lookups.
    return IntCandidate("onednn_int8", OneDnnInt8Linear, takes, torch.__version__, False)
