"""QuantLinear: a linear whose weight is an IntWeight, the module a quantized checkpoint loads
into (as `Linear` is for a dense one), and torch's implementation of it: dequantize, then
multiply. That runs on every device and dtype; a linear method with an integer kernel (the C++
kernel on CPU) replaces it at bind with a module over the kernel's own layout.

The IntWeight's tensors are this module's parameters (no autograd), so the loader fills them
by name, shard by shard for a merged linear (rows of `packed`, `scales`, `offsets`, `bias`;
under act order each shard's permutation is a row of `perm`, and they must agree).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from batchpage.ops.linear import LinearOp
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantLinear(LinearOp):
    """y = x @ W.T + b with W an IntWeight of `scheme`; `part_sizes` the output rows of each
    projection a merged linear stacks (one part otherwise)."""

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(part_sizes)
        self.part_sizes, self.scheme = tuple(part_sizes), scheme
        n, k = self.out_features, in_features
        self.group_size = k if scheme.group_size is None else scheme.group_size
        groups = -(-k // self.group_size)
        width = -(-k // 2) if scheme.bits == 4 else k
        self.packed = _param((n, width), torch.uint8, device)
        self.scales = _param((n, groups), torch.float32, device)
        self.offsets = _param((n, groups), torch.float32, device)
        # Under act order: a row per shard of a merged linear, or the one permutation.
        perm_shape = (len(part_sizes), k) if len(part_sizes) > 1 else (k,)
        self.perm = _param(perm_shape, torch.int64, device) if scheme.act_order else None
        self.bias = _param((n,), dtype, device) if bias else None

    def shard_keys(self, leaf: str) -> list[Hashable]:
        return list(range(len(self.part_sizes))) if len(self.part_sizes) > 1 else [None]

    def shard_view(self, leaf: str, key: Hashable) -> torch.Tensor:
        assert isinstance(key, int)
        if leaf == "perm":
            return self.perm[key]
        start = sum(self.part_sizes[:key])
        return getattr(self, leaf).narrow(0, start, self.part_sizes[key])

    def int_weight(self) -> IntWeight:
        """The loaded weight. Raises ValueError where a merged linear's shards were permuted
        differently (an act-order checkpoint batchpage cannot merge)."""
        perm = None
        if self.perm is not None:
            perms = self.perm if self.perm.dim() == 2 else self.perm.unsqueeze(0)
            perm = perms[0]
            if not all(torch.equal(perm, p) for p in perms[1:]):
                raise ValueError(
                    "the shards of a merged linear have different act orders (g_idx): "
                    "batchpage runs merged q/k/v and gate/up with one input permutation"
                )
        return IntWeight(
            self.packed.data,
            self.scales.data,
            self.offsets.data,
            self.scheme.bits,
            self.group_size,
            self.in_features,
            perm,
            self.scheme.float8,
        )

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        weight = self.int_weight()
        if weight.perm is not None:
            x = x.index_select(1, weight.perm)
        if self.scheme.int8_activations:  # W8A8: int8 rows times int8 weights, then the scales
            values, row_scales = quantize_rows_int8(x)
            dense = weight.dequantize_stored(torch.float32)
            y = F.linear(values.float(), dense) * row_scales
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        dense = weight.dequantize_stored(torch.float32).to(x.dtype)
        return F.linear(x, dense, self.bias)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.int_weight().dequantize_rows(ids)

    @property
    def weight_format(self) -> str:
        return self.scheme.name

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.scheme.name}, group_size={self.group_size}"
        )
