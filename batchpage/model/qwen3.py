"""Qwen3: Llama's block with an RMSNorm over each head of q and k before rope (`q_norm`,
`k_norm`). Its head_dim is its own (not hidden_size / heads), and q/k/v/o biases follow
`attention_bias`; config.py reads both."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM, ShardKey
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, DecoderLayer, GatedMLP
from batchpage.model.llama import SPLIT_PROJECTIONS


class Qwen3ForCausalLM(CausalLM):
    family = "qwen3"
    RENAMES: ClassVar[dict[str, tuple[str, ShardKey]]] = SPLIT_PROJECTIONS

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        attn = Attention(layer, cfg, dtype, device, qk_norm=True)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        return DecoderLayer(cfg, attn, mlp, dtype, device)
