"""The MoE block: routing and grouped experts against a plain per-token loop, one matmul per
expert, and the checkpoint names of each family's experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchpage.model.config import MoEConfig
from batchpage.model.moe import SparseMoE, expert_target


def random_moe(experts: int, top_k: int, norm: bool, seed: int = 0) -> SparseMoE:
    moe = SparseMoE(16, MoEConfig(experts, top_k, 24, norm, (True,)), torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return moe


def per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: softmax over all experts, its top k, their MLPs weighted."""
    out = torch.zeros_like(x)
    gate_up, down, inter = moe.experts.gate_up, moe.experts.down, moe.experts.intermediate
    for t in range(x.shape[0]):
        probs = F.softmax(x[t] @ moe.gate.weight.T, dim=-1)
        top = probs.topk(moe.top_k)
        weights = top.values / top.values.sum() if moe.norm_topk_prob else top.values
        for w, e in zip(weights, top.indices.tolist(), strict=True):
            h = gate_up[e] @ x[t]
            out[t] += w * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize(("experts", "top_k", "norm"), [(4, 2, True), (8, 3, False), (6, 1, True)])
def test_grouped_experts_match_a_per_token_loop(experts, top_k, norm):
    moe = random_moe(experts, top_k, norm)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), per_token_reference(moe, x), atol=1e-5, rtol=1e-5)


def test_each_expert_runs_once_per_step(monkeypatch):
    moe = random_moe(8, 2, True)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    calls: list[tuple[int, int]] = []
    run = moe.experts.run
    monkeypatch.setattr(moe.experts, "run", lambda e, xs: calls.append((e, len(xs))) or run(e, xs))
    with torch.no_grad():
        moe(x)
        _, chosen = moe.route(x)
    hit = torch.bincount(chosen.flatten(), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(hit.tolist()) if n]
    assert sum(n for _, n in calls) == 64 * 2


def test_expert_checkpoint_names():
    qwen = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    assert expert_target("layers.3.mlp.experts.12.up_proj.weight", "mlp", qwen) == (
        "layers.3.mlp.experts.gate_up",
        (12, 1),
    )
    assert expert_target("layers.0.mlp.experts.0.down_proj.weight", "mlp", qwen) == (
        "layers.0.mlp.experts.down",
        0,
    )
    mixtral = {"w1": "gate", "w3": "up", "w2": "down"}
    assert expert_target(
        "layers.1.block_sparse_moe.experts.7.w1.weight", "block_sparse_moe", mixtral
    ) == (
        "layers.1.mlp.experts.gate_up",
        (7, 0),
    )
    assert expert_target("layers.1.mlp.gate.weight", "mlp", qwen) is None
    assert expert_target("layers.1.mlp.experts.0.w1.weight", "mlp", qwen) is None


def test_expert_shards_fill_each_expert():
    moe = random_moe(3, 2, True)
    experts = moe.experts
    assert experts.shard_keys("gate_up") == [(e, p) for e in range(3) for p in (0, 1)]
    assert experts.shard_keys("down") == [0, 1, 2]
    up = experts.shard_view("gate_up", (2, 1))
    assert up.shape == (24, 16) and up.data_ptr() == experts.gate_up[2, 24:].data_ptr()
    assert experts.shard_view("down", 1).shape == (16, 24)
