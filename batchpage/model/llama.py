"""Llama, Mistral and Qwen2: pre-norm blocks of grouped-query attention (rope, q/k/v biases where
the config asks for them) and a SiLU-gated MLP. The three differ only in config numbers, which
config.py reads; the checkpoints name their tensors alike."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM, ShardKey
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, DecoderLayer, GatedMLP

# q/k/v and gate/up are stored separately in the checkpoint, merged here into one matmul each.
SPLIT_PROJECTIONS: dict[str, tuple[str, ShardKey]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(CausalLM):
    family = "llama"
    RENAMES: ClassVar[dict[str, tuple[str, ShardKey]]] = SPLIT_PROJECTIONS

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        attn = Attention(layer, cfg, dtype, device)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        return DecoderLayer(cfg, attn, mlp, dtype, device)
