"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration): SigLIP's tower, whose patch grid is
average-pooled to mm_tokens_per_image rows, each normed by Gemma's RMSNorm and projected into
Gemma 3's language model in place of the image's <image_soft_token> embeddings. Those rows enter
unscaled, while the text's embeddings are scaled by sqrt(hidden) (Gemma2ForCausalLM.forward), as
in HF.

An image's rows attend to each other both ways, on the full and the sliding-window layers
(BIDIRECTIONAL_IMAGES: the engine keeps each image's span in one chunk and bounds its rows' keys
by the span's end, engine/image_spans.py), as HF's token_type_ids mask does. On a windowed layer
a row of a span still sees no key before its own window, as in HF, where the window's bound is
applied after the span's.

Checkpoints come in two layouts, both read here, the tower's tensors with or without SigLIP's
`vision_model.` level: transformers >= 4.52 names them `model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*` and `lm_head.*`; 4.50 (the Hub's
checkpoints), and transformers 5 when it saves, `language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*` and `multi_modal_projector.*`. The projection is
stored as a plain matrix [vision hidden, text hidden] (`mm_input_projection_weight`): here it
is one of the engine's linears, loaded transposed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from batchpage.model.gemma import Gemma3ForCausalLM
from batchpage.model.gemma_layers import GemmaRMSNorm
from batchpage.model.layers import linear
from batchpage.model.siglip_vision import SiglipVisionTower
from batchpage.model.vision_config import VisionConfig
from batchpage.model.vision_lm import VisionLanguageBase
from batchpage.ops.linear import LinearOp

_TOWER = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+\..*)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")
_PROJECTION = "mm_input_projection_weight"
# Tower tensors Gemma 3 never reads: SigLIP's attention-pooling head (vision_use_head), and the
# position ids buffer older checkpoints store.
_UNREAD_TOWER = ("head.", "embeddings.position_ids")


class Gemma3Projector(nn.Module):
    """The tower's rows [N, side * side, vision hidden] -> [N, tokens_per_image, text hidden]:
    each (side / tokens per side)-square of patches averaged, normed, projected."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.side = vision.image_size // vision.patch_size
        self.kernel = self.side // round(vision.tokens_per_image**0.5)
        self.mm_soft_emb_norm = GemmaRMSNorm(
            vision.hidden_size, vision.layer_norm_eps, dtype, device
        )
        self.proj: LinearOp = linear(vision.hidden_size, text_hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        return self.proj(self.mm_soft_emb_norm(pooled))


class Gemma3Vision(nn.Module):
    """The image side: pixels [N, C, S, S] (S: the tower's image_size) -> [N, tokens_per_image,
    text hidden]."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = vision
        self.tower = SiglipVisionTower(vision, dtype, device)
        self.projector = Gemma3Projector(vision, text_hidden, dtype, device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixels, None))


class Gemma3ForConditionalGeneration(VisionLanguageBase, Gemma3ForCausalLM):
    VISION = Gemma3Vision
    family = "gemma3_vl"
    BIDIRECTIONAL_IMAGES: ClassVar[bool] = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes either checkpoint layout (the module docstring): the image side's tensors are
        renamed here, the text model's by Gemma3ForCausalLM."""
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if tower := _TOWER.match(name):
                rest = tower.group(1)
                if rest.startswith(_UNREAD_TOWER):
                    continue
                if layer := _TOWER_LAYER.match(rest):
                    rest = f"layers.{layer.group(1)}"
                yield f"vision.tower.{rest}", tensor
            elif projector := _PROJECTOR.match(name):
                rest = projector.group(1)
                if rest == _PROJECTION:  # x @ W: the linear's weight is W transposed
                    yield "vision.projector.proj.weight", tensor.t()
                else:
                    yield f"vision.projector.{rest}", tensor
            else:
                yield name, tensor
