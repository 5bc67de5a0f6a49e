"""Qwen2.5-VL: its vision transformer (qwen2_5_vision.py) makes each image's rows, which take the
place of the image's <|image_pad|> tokens' embeddings in a Qwen2 language model whose positions
are 3-D (M-RoPE: model/mrope.py, applied by rope.py from ModelConfig.mrope_section).

An image takes as many placeholders as its size makes (its grid t * h * w / spatial_merge_size**2
rows; image_rules.py expands one <|image_pad|> into them). The language model is Llama's
(`LlamaForCausalLM`, Qwen2's q/k/v biases from its config); `vision` is the tower.

Images only: they go through the folder's Qwen2VLImageProcessor alone, which transformers falls
back to its PIL version of here (image_prompt.py asks for it: torchvision cannot be installed
beside batchpage's torch), never through the whole Qwen2_5_VLProcessor, whose video processor
needs torchvision. Videos are not taken.

Checkpoints come in two layouts, both read here: transformers >= 4.52 (and 5.x) writes
`model.language_model.*`, `model.visual.*` and `lm_head.*`; earlier releases (and the Hub's
released folders) `model.*` for the language model, `visual.*` and `lm_head.*`. The patch
embedding is stored as a Conv3d weight [hidden, C, T, P, P], loaded as the linear's
[hidden, C * T * P * P]; the merger's MLP is `merger.mlp.0` and `merger.mlp.2`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from batchpage.model.qwen2_5_vision import Grid, Qwen2_5VisionTower
from batchpage.model.vision_lm import VisionLanguageModel

_TEXT = "model.language_model."
_VISUAL = re.compile(r"^(?:model\.)?visual\.(.*)$")
_VISUAL_RENAMES = (
    ("patch_embed.proj.", "patch_embed."),
    ("merger.mlp.0.", "merger.fc1."),
    ("merger.mlp.2.", "merger.fc2."),
)


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    VISION = Qwen2_5VisionTower
    family = "qwen2_5_vl"

    @torch.no_grad()
    def encode_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's processor outputs (pixel_values [t * h * w, C * T * P * P],
        image_grid_thw [1, 3]) -> its rows [t * h * w / merge**2, text hidden] in the model's
        dtype, as HF's get_image_features. The images run through the tower as one sequence.
        Raises ValueError for outputs of another shape."""
        if not inputs:
            return []
        grids = [self._grid(i, one) for i, one in enumerate(inputs)]
        weight = self.vision.merger.ln_q.weight  # a linear's may be packed
        pixels = torch.cat([one["pixel_values"] for one in inputs])
        rows = self.vision(pixels.to(device=weight.device, dtype=weight.dtype), grids)
        merge = self.vision.config.spatial_merge_size
        return list(rows.split([t * h * w // merge**2 for t, h, w in grids]))

    def _grid(self, index: int, inputs: dict[str, torch.Tensor]) -> Grid:
        """One image's grid (t, h, w) in patches, checked against its pixel values."""
        vision = self.vision.config
        pixels, grid = inputs["pixel_values"], inputs.get("image_grid_thw")
        t, h, w = (int(n) for n in grid.reshape(-1).tolist()) if grid is not None else (0, 0, 0)
        if (
            grid is None
            or grid.numel() != 3
            or pixels.dim() != 2
            or pixels.shape != (t * h * w, self.vision.patch_dim)
            or not t * h * w
            or h % vision.spatial_merge_size
            or w % vision.spatial_merge_size
        ):
            raise ValueError(
                f"image {index}: pixel_values of shape {tuple(pixels.shape)} for image_grid_thw "
                f"{None if grid is None else grid.tolist()}; this model takes "
                f"[t * h * w, {self.vision.patch_dim}] patches of a grid whose sides are "
                f"multiples of spatial_merge_size={vision.spatial_merge_size}: use the model's "
                "own image processor"
            )
        return t, h, w

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes either checkpoint layout (the module docstring)."""
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if visual := _VISUAL.match(name):
                rest = visual.group(1)
                for theirs, ours in _VISUAL_RENAMES:
                    if rest.startswith(theirs):
                        rest = ours + rest.removeprefix(theirs)
                        break
                if rest == "patch_embed.weight":  # the Conv3d's kernel, flattened
                    tensor = tensor.reshape(tensor.shape[0], -1)
                yield f"vision.{rest}", tensor
            elif name.startswith(_TEXT):
                yield "model." + name.removeprefix(_TEXT), tensor
            else:
                yield name, tensor
