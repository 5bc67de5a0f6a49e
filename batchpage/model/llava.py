"""LLaVA: a CLIP vision tower and a two-layer MLP projector whose outputs take the place of the
image placeholder tokens' embeddings in a Llama, Mistral or Qwen2 language model.

The language model is Llama's (`LlamaForCausalLM`); `vision` holds the image side, and
`encode_images` turns each image's processor outputs into its embedding rows, which the engine
passes to `forward` in place of the placeholders' token embeddings.

Checkpoints come in two layouts, both read here: transformers >= 4.52 writes
`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*` and
`lm_head.*`; earlier releases (and the Hub's llava-hf folders) `language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*` and `multi_modal_projector.*`. The tower's tensors
sit under `vision_model.` in CLIPVisionModel's layout, which transformers 5 drops when it saves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from batchpage.model.clip_vision import ACTIVATIONS, ClipVisionTower
from batchpage.model.layers import linear
from batchpage.model.vision_config import VisionConfig
from batchpage.model.vision_lm import VisionLanguageModel
from batchpage.ops.linear import LinearOp

# The checkpoint's language-model prefixes -> CausalLM's names.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_TOWER = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")
_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.*)$")
# Tower tensors HF keeps that LLaVA's image features never read: the final norm, and the
# position ids buffer that checkpoints written before transformers 4.31 store.
_UNREAD_TOWER = ("post_layernorm.", "embeddings.position_ids")


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(features))): the tower's selected states -> the text model's rows."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        features = vision.hidden_size * len(vision.feature_layer)
        bias = vision.projector_bias
        self.linear_1: LinearOp = linear(features, text_hidden, bias, dtype, device)
        self.act = ACTIVATIONS[vision.projector_act]
        self.linear_2: LinearOp = linear(text_hidden, text_hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """The image side: pixels [N, C, S, S] -> [N, tokens_per_image, text hidden]."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = vision
        self.tower = ClipVisionTower(vision, dtype, device)
        self.projector = LlavaProjector(vision, text_hidden, dtype, device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.tower(pixels)
        if self.config.feature_select == "default":  # the CLS row dropped
            states = [s[:, 1:] for s in states]
        return self.projector(torch.cat(states, dim=-1))


class LlavaForConditionalGeneration(VisionLanguageModel):
    VISION = LlavaVision
    family = "llava"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes either checkpoint layout (the module docstring); the tower's tensors that the
        selected features never read (its final norm, the layers past the deepest selected)
        are skipped by name."""
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        vision = self.vision.config
        depth = self.vision.tower.depth
        for name, tensor in weights:
            if tower := _TOWER.match(name):
                rest = tower.group(1)
                if rest.startswith(_UNREAD_TOWER):
                    continue
                if layer := _TOWER_LAYER.match(rest):
                    index = int(layer.group(1))
                    if depth <= index < vision.num_layers:
                        continue
                    rest = f"layers.{index}.{layer.group(2)}"
                yield f"vision.tower.{rest}", tensor
            elif projector := _PROJECTOR.match(name):
                yield f"vision.projector.{projector.group(1)}", tensor
            else:
                for theirs, ours in _TEXT_PREFIXES:
                    if name.startswith(theirs):
                        name = ours + name.removeprefix(theirs)
                        break
                yield name, tensor
