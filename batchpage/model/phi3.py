"""Phi-3 (and Phi-4-mini, which shares its model_type): Llama's block, stored the way it runs,
with q/k/v fused in `qkv_proj` and gate/up in `gate_up_proj`. Its 128k variants use longrope
scaling; Phi-4-mini rotates only part of each head (partial_rotary_factor); rope.py does both."""

from __future__ import annotations

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, DecoderLayer, GatedMLP


class Phi3ForCausalLM(CausalLM):
    family = "phi3"  # checkpoint names equal ours: no RENAMES

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        attn = Attention(layer, cfg, dtype, device)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        return DecoderLayer(cfg, attn, mlp, dtype, device)
