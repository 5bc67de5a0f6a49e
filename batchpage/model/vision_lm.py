"""What every vision-language family shares: a language model behind a vision tower.

A family says which module is its tower and projector (`VISION`, built from ModelConfig.vision)
and how an image's processor outputs become its embedding rows (`encode_images`); the engine
feeds those rows in place of the image's placeholder embeddings (CausalLM.forward's `embeds`).

`VisionLanguageBase` goes with any language model class, listed after it among a family's bases
(Gemma 3's: `class Gemma3ForConditionalGeneration(VisionLanguageBase, Gemma3ForCausalLM)`);
`VisionLanguageModel` is it over Llama's (LLaVA, Idefics3). The engine knows a vision-language
model by VisionLanguageBase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.llama import LlamaForCausalLM
from batchpage.model.shard import TensorShard
from batchpage.model.vision_config import VisionConfig

VisionFactory = Callable[[VisionConfig, int, torch.dtype, torch.device], nn.Module]


class VisionLanguageBase(CausalLM):
    # (the VisionConfig, the text model's hidden size, dtype, device) -> the tower + projector
    VISION: ClassVar[VisionFactory]
    # Whether an image's rows attend to each other both ways (Gemma 3), read once by the engine:
    # its scheduler then never ends a prompt chunk inside an image's span and its steps bound
    # those rows' keys by the span's end (engine/image_spans.py). False: causal, as text.
    BIDIRECTIONAL_IMAGES: ClassVar[bool] = False

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
        shard: TensorShard | None = None,
    ):
        """The tower and projector are whole on every tensor-parallel rank (small beside the
        language model, run once per image)."""
        super().__init__(cfg, dtype=dtype, device=device, max_positions=max_positions, shard=shard)
        if cfg.vision is None:
            raise ValueError(f"a {self.family} model needs its VisionConfig (ModelConfig.vision)")
        where = torch.device(device if device is not None else "cpu")
        self.vision = type(self).VISION(cfg.vision, cfg.hidden_size, dtype, where)

    @torch.no_grad()
    def encode_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's processor outputs -> its embedding rows [rows, text hidden] in the
        model's dtype, in the order of `inputs`, as HF's get_image_features.

        This one is for towers that take one image_size square per image (LLaVA's CLIP, Gemma
        3's SigLIP): pixel_values [1, C, S, S] each, run as one batch through `vision`, whose
        tower's patch embedding says the dtype and device; ValueError for pixel values of
        another shape. A family whose images are tiles or grids overrides it."""
        if not inputs:
            return []
        vision = self.vision.config
        want = (1, vision.num_channels, vision.image_size, vision.image_size)
        for i, one in enumerate(inputs):
            got = tuple(one["pixel_values"].shape)
            if got != want:
                raise ValueError(
                    f"image {i}: pixel_values of shape {got}, this model's tower takes {want}: "
                    "use the model's own image processor"
                )
        weight = self.vision.tower.embeddings.patch_embedding.weight
        pixels = torch.cat([one["pixel_values"] for one in inputs])
        rows = self.vision(pixels.to(device=weight.device, dtype=weight.dtype))
        return list(rows.unbind(0))


class VisionLanguageModel(VisionLanguageBase, LlamaForCausalLM):
    """A Llama, Mistral or Qwen2 language model behind a vision tower (LLaVA, Idefics3)."""
