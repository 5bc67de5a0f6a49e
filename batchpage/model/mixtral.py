"""Mixtral: Mistral's attention with a top-2 MoE block in every layer (softmax over the chosen
experts). The checkpoint calls the block `block_sparse_moe`, its router `gate` and each
expert's gate/down/up projections `w1`/`w2`/`w3`."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM, ShardKey
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, DecoderLayer
from batchpage.model.llama import SPLIT_PROJECTIONS
from batchpage.model.moe import SparseMoE, expert_target

_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}


class MixtralForCausalLM(CausalLM):
    family = "mixtral"
    RENAMES: ClassVar[dict[str, tuple[str, ShardKey]]] = {
        **SPLIT_PROJECTIONS,
        "block_sparse_moe.gate": ("mlp.gate", None),
    }

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        if cfg.moe is None:
            raise ValueError("a Mixtral config needs its experts (num_local_experts)")
        attn = Attention(layer, cfg, dtype, device)
        return DecoderLayer(
            cfg, attn, SparseMoE(cfg.hidden_size, cfg.moe, dtype, device), dtype, device
        )

    def checkpoint_target(self, name: str) -> tuple[str, ShardKey]:
        return expert_target(name, "block_sparse_moe", _EXPERT_PARTS) or super().checkpoint_target(
            name
        )
