"""Idefics3 and SmolVLM: a SigLIP vision tower whose rows, scale_factor x scale_factor patches at
a time, are projected by one linear into a Llama language model, in place of the image
placeholder tokens' embeddings.

An image reaches the tower as tiles (its image processor's split crops, then the whole image
downscaled), each tile making (patches per side / scale_factor)**2 rows, in tile order. The
language model is Llama's (`LlamaForCausalLM`); `vision` holds the image side.

Checkpoints (transformers 4.x and 5.x alike, both model types) name the language model
`model.text_model.*` and `lm_head.*`, the tower `model.vision_model.*`, the projection
`model.connector.modality_projection.proj.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from batchpage.model.layers import linear
from batchpage.model.siglip_vision import SiglipVisionTower, patch_mask
from batchpage.model.vision_config import VisionConfig
from batchpage.model.vision_lm import VisionLanguageModel
from batchpage.ops.linear import LinearOp

_TEXT = ("model.text_model.", "model.")
_TOWER = re.compile(r"^model\.vision_model\.(.*)$")
_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+\..*)$")
_PROJECTION = "model.connector.modality_projection.proj."


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, S, D] rows of a square side x side patch grid -> [N, S / scale**2, scale**2 * D]: row
    (i, j) of the (side / scale)**2 grid is patches (i * scale + r, j * scale + c) side by side,
    r-major then c, as Idefics3's connector orders them."""
    n, s, d = x.shape
    side = round(s**0.5)
    cells = side // scale
    x = x.view(n, cells, scale, cells, scale, d)  # (i, r, j, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, cells * cells, scale * scale * d)


class Idefics3Vision(nn.Module):
    """The image side: tiles [N, C, H, W] and their real patches -> [N, rows per tile, text
    hidden]."""

    def __init__(
        self, vision: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = vision
        self.tower = SiglipVisionTower(vision, dtype, device)
        features = vision.hidden_size * vision.scale_factor**2
        self.proj: LinearOp = linear(features, text_hidden, False, dtype, device)

    def forward(self, pixels: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_shuffle(self.tower(pixels, patches), self.config.scale_factor))


def real_tiles(pixels: torch.Tensor) -> torch.Tensor:
    """pixel_values [..., C, H, W] -> bool [...]: the tiles that are not padding. Padding tiles
    are all zeros, and transformers drops exactly the all-zero tiles."""
    return pixels.flatten(-3).ne(0).any(dim=-1)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    VISION = Idefics3Vision
    family = "idefics3"

    @torch.no_grad()
    def encode_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's processor outputs (pixel_values [1, tiles, C, H, W], pixel_attention_mask
        [1, tiles, H, W] optional) -> its embedding rows [real tiles x rows per tile, text
        hidden] in the model's dtype, tile after tile, as HF's get_image_features: all-zero
        tiles (padding) dropped, padding pixels masked. Images whose tiles have the same size
        run as one batch. Raises ValueError for tiles the connector cannot take."""
        weight = self.vision.tower.embeddings.patch_embedding.weight  # a linear's may be packed
        tiles = [self._tiles(i, one) for i, one in enumerate(inputs)]
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, (pixels, _) in enumerate(tiles):
            by_size.setdefault(tuple(pixels.shape[-2:]), []).append(i)
        out: dict[int, torch.Tensor] = {}
        for group in by_size.values():
            pixels = torch.cat([tiles[i][0] for i in group]).to(weight.device, weight.dtype)
            masks = torch.cat([tiles[i][1] for i in group]).to(weight.device)
            rows = self.vision(pixels, patch_mask(masks, self.vision.config.patch_size))
            counts = [tiles[i][0].shape[0] for i in group]
            for i, part in zip(group, rows.split(counts), strict=True):
                out[i] = part.reshape(-1, part.shape[-1])
        return [out[i] for i in range(len(inputs))]

    def _tiles(
        self, index: int, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's (pixel_values [..., C, H, W], pixel_attention_mask [..., H, W] or none)
        -> its real tiles [tiles, C, H, W] and their pixel masks [tiles, H, W], checked: the
        channels, a square patch grid that the pixel shuffle divides, a mask of the pixels'
        shape."""
        vision = self.vision.config
        pixels = inputs["pixel_values"]
        mask = inputs.get("pixel_attention_mask")
        side = pixels.shape[-1] // vision.patch_size if pixels.dim() >= 4 else 0
        if (
            not side
            or pixels.shape[-3] != vision.num_channels
            or pixels.shape[-2] != pixels.shape[-1]
            or side % vision.scale_factor
        ):
            raise ValueError(
                f"image {index}: pixel_values of shape {tuple(pixels.shape)}; this model takes "
                f"square tiles of {vision.num_channels} channels whose side in patches of "
                f"{vision.patch_size} is a multiple of scale_factor={vision.scale_factor}: use "
                "the model's own image processor"
            )
        if mask is not None and mask.shape != pixels.shape[:-3] + pixels.shape[-2:]:
            raise ValueError(
                f"image {index}: pixel_attention_mask of shape {tuple(mask.shape)} for "
                f"pixel_values of shape {tuple(pixels.shape)}: use the model's own image processor"
            )
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        if mask is None:
            mask = pixels.new_ones(pixels.shape[:1] + pixels.shape[2:])
        real = real_tiles(pixels)
        return pixels[real], mask.reshape(pixels.shape[:1] + pixels.shape[2:])[real]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes the checkpoint layout of the module docstring."""
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        theirs, ours = _TEXT
        for name, tensor in weights:
            if tower := _TOWER.match(name):
                rest = tower.group(1)
                if layer := _TOWER_LAYER.match(rest):
                    rest = f"layers.{layer.group(1)}"
                yield f"vision.tower.{rest}", tensor
            elif name.startswith(_PROJECTION):
                yield f"vision.proj.{name.removeprefix(_PROJECTION)}", tensor
            elif name.startswith(theirs):
                yield ours + name.removeprefix(theirs), tensor
            else:
                yield name, tensor
