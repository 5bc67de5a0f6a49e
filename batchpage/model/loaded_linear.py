"""LoadedLinear: a linear of a model as it is built and loaded, before bind makes its module.

It holds its `LinearSpec` and the checkpoint's tensors in the form the spec says: a dense
`weight` (and `bias`), or a quantized checkpoint's IntWeight tensors (`packed`, `scales`,
`offsets`, under act order `perm`), which `load_weights` fills by name, shard by shard for a
merged linear (rows of each; under act order each shard's permutation is a row of `perm`, and
they must agree). `CausalLM.bind` hands its spec and tensors to the engine's LinearMethod
(`LinearMethod.create`), whose module replaces it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import torch
from torch import nn

from batchpage.ops.linear import LinearOp, dtype_format
from batchpage.ops.linear_method import TORCH_LINEARS, LinearSpec, LinearWeights
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme

INT_LEAVES = ("packed", "scales", "offsets", "perm")


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Inference only: uninitialised until loaded, no autograd.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LoadedLinear(LinearOp):
    """The spec's tensors, to be loaded. Before bind it also computes (torch's way: tests and
    reference checks), so a model runs as built."""

    def __init__(self, spec: LinearSpec, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.spec = spec
        self.bias = _param((self.out_features,), spec.dtype, self.device) if spec.bias else None
        self._allocate()

    def hold(self, scheme: QuantScheme | None) -> None:
        """Hold the checkpoint's weight in `scheme`'s form (None: dense), before loading."""
        for leaf in ("weight", *INT_LEAVES):
            if hasattr(self, leaf):
                delattr(self, leaf)
        self.spec = replace(self.spec, scheme=scheme)
        self._allocate()

    def _allocate(self) -> None:
        spec, n, k = self.spec, self.out_features, self.in_features
        if spec.scheme is None:
            self.weight = _param((n, k), spec.dtype, self.device)
            return
        group = k if spec.scheme.group_size is None else spec.scheme.group_size
        groups = -(-k // group)
        width = -(-k // 2) if spec.scheme.bits == 4 else k
        self.packed = _param((n, width), torch.uint8, self.device)
        self.scales = _param((n, groups), torch.float32, self.device)
        self.offsets = _param((n, groups), torch.float32, self.device)
        parts = len(spec.part_sizes)
        if spec.scheme.act_order:  # a row per shard of a merged linear, or the one permutation
            self.perm = _param((parts, k) if parts > 1 else (k,), torch.int64, self.device)

    def shard_keys(self, leaf: str) -> list[Hashable]:
        parts = len(self.spec.part_sizes)
        return list(range(parts)) if parts > 1 else [None]

    def shard_view(self, leaf: str, key: Hashable) -> torch.Tensor:
        assert isinstance(key, int)
        if leaf == "perm":
            return self.perm[key]
        start = sum(self.spec.part_sizes[:key])
        return getattr(self, leaf).narrow(0, start, self.spec.part_sizes[key])

    def weights(self) -> LinearWeights:
        """The loaded tensors. Raises ValueError where a merged linear's shards were permuted
        differently (an act-order checkpoint batchpage cannot merge)."""
        bias = None if self.bias is None else self.bias.data
        scheme = self.spec.scheme
        if scheme is None:
            return LinearWeights(self.weight.data, None, bias)
        perm = None
        if scheme.act_order:
            perms = self.perm.data if self.perm.dim() == 2 else self.perm.data.unsqueeze(0)
            perm = perms[0]
            if not all(torch.equal(perm, p) for p in perms[1:]):
                raise ValueError(
                    "the shards of a merged linear have different act orders (g_idx): "
                    "batchpage runs merged q/k/v and gate/up with one input permutation"
                )
        group = self.in_features if scheme.group_size is None else scheme.group_size
        quant = IntWeight(
            self.packed.data,
            self.scales.data,
            self.offsets.data,
            scheme.bits,
            group,
            self.in_features,
            perm,
            scheme.float8,
        )
        return LinearWeights(None, quant, bias)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return TORCH_LINEARS.create(self.spec, self.weights()).apply(x, out)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        dense, quant, _ = self.weights()
        return dense[ids].float() if quant is None else quant.dequantize_rows(ids)

    @property
    def weight_format(self) -> str:
        scheme = self.spec.scheme
        return dtype_format(self.spec.dtype) if scheme is None else scheme.name

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={self.spec.part_sizes}, {self.weight_format}"
