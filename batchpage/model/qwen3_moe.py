"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse MoE block in the layers that
`decoder_sparse_step` and `mlp_only_layers` select, and a dense MLP in the others. Experts are
stored one tensor per projection: `mlp.experts.<e>.{gate,up,down}_proj`, the router `mlp.gate`."""

from __future__ import annotations

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM, ShardKey
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, DecoderLayer, GatedMLP
from batchpage.model.llama import SPLIT_PROJECTIONS
from batchpage.model.moe import SparseMoE, expert_target

_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class Qwen3MoeForCausalLM(CausalLM):
    family = "qwen3_moe"
    RENAMES = SPLIT_PROJECTIONS  # attention, and the dense MLP layers

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        attn = Attention(layer, cfg, dtype, device, qk_norm=True)
        mlp: nn.Module
        if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            mlp = SparseMoE(cfg.hidden_size, cfg.moe, dtype, device)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        return DecoderLayer(cfg, attn, mlp, dtype, device)

    def checkpoint_target(self, name: str) -> tuple[str, ShardKey]:
        return expert_target(name, "mlp", _EXPERT_PARTS) or super().checkpoint_target(name)
