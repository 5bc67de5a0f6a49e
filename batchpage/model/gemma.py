"""Gemma 2 and Gemma 3 (text): sandwich-normed blocks of GeGLU and grouped-query attention with
sliding windows on some layers, token embeddings scaled by sqrt(hidden), and the final logits
soft-capped where the config says so.

- Gemma 2: windowed and global layers alternate; attention scores are soft-capped.
- Gemma 3: (1 + weight) RMSNorm of q and k; five local layers per global one, the local ones
  with their own rope base and without the global rope scaling.
gemma_config.py reads both from HF configs and GGUF headers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.causal_lm import CausalLM, ImageEmbeds, ShardKey
from batchpage.model.config import ModelConfig
from batchpage.model.gemma_layers import GeGLUMLP, GemmaAttention, GemmaDecoderLayer, GemmaRMSNorm
from batchpage.model.llama import SPLIT_PROJECTIONS
from batchpage.model.rope import RotaryEmbedding
from batchpage.model.shard import TensorShard
from batchpage.ops.workspace import Workspace

# Where a Gemma 3 multimodal checkpoint keeps its text model (transformers 4.50-4.51 and later
# layouts), and the tensors of its image side, which a text-only engine leaves unread.
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_IMAGE_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma2ForCausalLM(CausalLM):
    family = "gemma2"
    RENAMES: ClassVar[dict[str, tuple[str, ShardKey]]] = SPLIT_PROJECTIONS
    QK_NORM: ClassVar[bool] = False

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
        shard: TensorShard | None = None,
    ):
        super().__init__(cfg, dtype=dtype, device=device, max_positions=max_positions, shard=shard)
        device = torch.device(device if device is not None else "cpu")
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.local_rotary = (
            None
            if cfg.local_rope_theta is None
            else RotaryEmbedding(
                replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None),
                self.max_positions,
                device,
            )
        )

    def make_layer(
        self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        attn = GemmaAttention(layer, cfg, dtype, device, qk_norm=self.QK_NORM)
        mlp = GeGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        return GemmaDecoderLayer(cfg, attn, mlp, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,
        embeds: ImageEmbeds | None = None,  # rows that replace token embeddings (images)
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x = self.embed_tokens(input_ids)
        ws = Workspace(x.shape[0], x.dtype, x.device)
        # HF rounds the scale to the model dtype before multiplying, so do the same
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        if embeds is not None:  # image rows enter unscaled, as in HF's Gemma 3
            embeds.apply(x)
        rope = self.rotary(positions, meta)
        local = rope if self.local_rotary is None else self.local_rotary(positions, meta)
        for i, layer in enumerate(self.layers):
            cos, sin = local if self.config.window(i) else rope
            x = layer(x, cos, sin, meta, kv, attn, ws)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> f32 [N, V]
        logits = super().compute_logits(hidden).float()  # the soft-cap in float32
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = "gemma3"
    QK_NORM: ClassVar[bool] = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Also takes a multimodal (Gemma3ForConditionalGeneration) checkpoint: its text model's
        tensors, renamed as in a text-only one; the image tower's are skipped."""
        super().load_weights(_text_model_weights(weights))


def _text_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_IMAGE_PREFIXES):
            continue
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
        yield name.removeprefix("language_model."), tensor  # language_model.lm_head.weight
