"""Linears with weights prepacked for oneDNN, the CPU path of the engine's matmuls.

`F.linear` on a CPU hands a plain row-major weight to the BLAS on every call, and a decode
step's matmuls have few rows (one per running sequence), where that call ran well below the
machine's matmul rate (the lm_head at 25-50 GFLOP/s at 16-64 rows, against 65-112 for oneDNN).
oneDNN reorders the weight once into its blocked layout (`mkldnn._reorder_linear_weight`) and
multiplies against it (`mkldnn._linear_pointwise`). Measured on a 2-core AMD EPYC (AVX2,
float32, SmolLM2-135M's shapes; BENCHMARKS.md, "Prepacked linears"): the 49152-row lm_head
runs 1.3-2.6x faster at every row count from 1 to 512, a layer's linears 1.45x at 16 rows,
1.1x at 64-256 and even at 512; at a single row the small ones are slower (0.7-0.8x), the
lm_head still 1.7x faster.

The packed weight is a copy in an opaque layout: `pack_linear_modules` (called by
`CausalLM.prepack_linears`) swaps each `nn.Linear` of a loaded model for a `PackedLinear`,
dropping the plain weight, so memory stays the same. The one exception is a tied lm_head: the
embedding keeps its plain table for lookups and the packed copy is extra (vocab x hidden
elements). Results differ from `F.linear` only by summation order (measured: about 5e-6 at
outputs of order 1 in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "torch")


@dataclass(frozen=True)
class PackReport:
    """What prepack_linears did: how many linears it packed and the extra bytes it kept (a tied
    lm_head's packed copy)."""

    packed: int
    extra_bytes: int


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout. Inference only (no autograd)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # [out, in] in oneDNN's layout; the batch-size hint is left to oneDNN, which measured
        # fastest across 1..512 rows.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def onednn_packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack and multiply `dtype` weights here: a CPU torch built with oneDNN,
    and for bfloat16 a CPU with the instructions oneDNN's bf16 path needs (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT); found by packing a tiny weight, which raises where it cannot."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        layer = PackedLinear(torch.ones(8, 8, dtype=dtype), None)
        layer(torch.ones(2, 8, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack_linear_modules(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear in place; returns how many. Call
    after the weights are loaded: the plain weights are gone afterwards."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, PackedLinear(module.weight, module.bias))
    return len(linears)


def use_onednn(choice: str, dtype: torch.dtype, device: torch.device) -> bool:
    """The engine's `linear_backend`: "torch" is F.linear; "onednn" packs or raises; "auto" packs
    wherever oneDNN can (on a CPU, for this dtype), else F.linear."""
    if choice not in LINEAR_BACKENDS:
        allowed = ", ".join(LINEAR_BACKENDS)
        raise ValueError(f"linear_backend must be one of {allowed}; got {choice!r}")
    if choice == "torch":
        return False
    packs = onednn_packs(dtype, device)
    if choice == "onednn" and not packs:
        raise ValueError(
            f"linear_backend='onednn' cannot pack {str(dtype).removeprefix('torch.')} weights on "
            f"{device}: it needs a CPU torch built with oneDNN, and for bfloat16 a CPU with "
            "AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; use linear_backend='auto' or 'torch'"
        )
    return packs
