"""The mixture-of-experts block shared by Qwen3-MoE and Mixtral.

A router picks top_k experts per token (softmax over all experts, then the top k, optionally
renormalized to sum to 1: that equals Mixtral's softmax over the chosen experts). The step's
(token, expert) pairs are then sorted by expert, so each expert runs one gate/up and one down
matmul over all of its tokens, instead of one per token.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from batchpage.model.config import MoEConfig
from batchpage.model.layers import UsesLayerOps, linear
from batchpage.ops.workspace import Workspace


class Experts(nn.Module):
    """Every expert's SiLU-gated MLP, stacked: gate_up [E, 2I, H] (gate rows, then up rows) and
    down [E, H, I]. Shards: (expert, 0 gate | 1 up) of gate_up, expert of down."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.intermediate = intermediate
        shape = (num_experts, 2 * intermediate, hidden)
        self.gate_up = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.down = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device)
        )

    def shard_keys(self, leaf: str) -> list[Hashable]:
        experts = range(self.gate_up.shape[0])
        return [(e, part) for e in experts for part in (0, 1)] if leaf == "gate_up" else [*experts]

    def shard_view(self, leaf: str, key: Hashable) -> torch.Tensor:
        if leaf == "gate_up":
            assert isinstance(key, tuple)
            expert, part = key
            return self.gate_up[expert].narrow(0, part * self.intermediate, self.intermediate)
        assert isinstance(key, int)
        return self.down[key]

    def run(self, expert: int, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, H]
        gate, up = F.linear(x, self.gate_up[expert]).split(self.intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[expert])


class SparseMoE(UsesLayerOps):
    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = linear(hidden, moe.num_experts, False, dtype, device)  # the router
        self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size, dtype, device)

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> weights [T, k] (x's dtype), ids [T, k]
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        ws: Workspace | None = None,  # the MLPs' interface; the experts' outputs are their own
    ) -> torch.Tensor:  # [T, H]
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * k]: pair j is token j // k
        order = flat.argsort(stable=True)
        # One host sync per layer to size the groups; each expert then runs one matmul.
        counts = torch.bincount(flat, minlength=self.experts.gate_up.shape[0]).tolist()
        tokens = order // self.top_k  # [T * k], grouped by expert
        grouped = x[tokens]  # [T * k, H]
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start : start + n] = self.experts.run(expert, grouped[start : start + n])
                start += n
        out *= weights.flatten()[order, None]
        # Each rank's experts hold a share of every expert's intermediate size: partial sums.
        return self.comm.all_reduce_(torch.zeros_like(x).index_add_(0, tokens, out))


_EXPERT_NAME = re.compile(r"^(?P<prefix>layers\.\d+)\.(?P<block>[\w.]+?)\.experts\.(?P<e>\d+)\.")


def expert_target(name: str, block: str, parts: dict[str, str]) -> tuple[str, Hashable] | None:
    """A checkpoint's per-expert tensor -> (our parameter, shard), or None if `name` is not one.

    block: the checkpoint's name for the MoE block (`mlp`, `block_sparse_moe`); parts: its
    projection names for gate, up, down (e.g. {"w1": "gate", "w3": "up", "w2": "down"})."""
    m = _EXPERT_NAME.match(name)
    if m is None or m["block"] != block:
        return None
    proj = name[m.end() :].removesuffix(".weight")
    if proj not in parts:
        return None
    ours, expert = f"{m['prefix']}.mlp.experts.", int(m["e"])
    role = parts[proj]
    if role == "down":
        return ours + "down", expert
    return ours + "gate_up", (expert, 0 if role == "gate" else 1)
