"""SigLIP's vision transformer as Idefics3, SmolVLM and Gemma 3 use it: a patch convolution with a
bias and learned position embeddings (no class row, no pre-norm), CLIP's encoder layers, and a
final LayerNorm whose output is the tower's.

Gemma 3 runs it as SigLIP itself does: whole image_size images, patch i at position i, no patch
mask. Idefics3's tiles may be smaller than the tower's image_size, or padded (a pixel mask marks
the real pixels): a patch is real when any of its pixels is. Each tile's real patches take
position embeddings spread over the whole image_size grid by their fraction of the tile's real
extent (a full tile's patches take positions 0, 1, ...; padding patches take position 0), and
every row attends to the real patches only. The linears are made with `layers.linear` /
`merged_linear` (clip_vision.py), so `CausalLM.bind` binds them like every other linear.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from batchpage.model.clip_vision import ClipEncoderLayer, layer_norm
from batchpage.model.vision_config import VisionConfig


def patch_mask(pixel_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """A pixel mask [N, H, W] (nonzero: a real pixel) -> bool [N, H // p, W // p]: the patches
    holding any real pixel. Pixels past the last whole patch are dropped, as the convolution
    drops them."""
    n, height, width = pixel_mask.shape
    rows, cols = height // patch_size, width // patch_size
    cut = pixel_mask[:, : rows * patch_size, : cols * patch_size] != 0
    return cut.view(n, rows, patch_size, cols, patch_size).any(dim=4).any(dim=2)


def position_ids(patches: torch.Tensor, side: int) -> torch.Tensor:
    """bool [N, h, w] real patches (a real top-left block per tile) -> int64 [N, h * w]: each real
    patch's index into the side x side grid of position embeddings, its row and column scaled by
    side / the tile's real rows and columns (bucketed as transformers does, in float32); padding
    patches 0."""
    n, h, w = patches.shape
    device = patches.device
    # The grid's bucket edges 1/side, 2/side, ... below 1.
    edges = torch.arange(1 / side, 1.0, 1 / side, device=device)

    def buckets(count: int, real: torch.Tensor) -> torch.Tensor:  # [N, count]
        step = 1.0 / real  # [N] float32: one real patch's share of the tile
        frac = torch.arange(count, device=device, dtype=torch.float32)[None, :] * step[:, None]
        return torch.bucketize(frac.clamp(max=1.0 - 1e-6), edges, right=True)

    rows = buckets(h, patches[:, :, 0].sum(dim=1))
    cols = buckets(w, patches[:, 0, :].sum(dim=1))
    ids = (rows[:, :, None] * side + cols[:, None, :]).view(n, h * w)
    return torch.where(patches.view(n, h * w), ids, torch.zeros_like(ids))


class SiglipEmbeddings(nn.Module):
    """Pixels [N, C, H, W] and their real patches [N, H/p, W/p] -> [N, patches, hidden], one row
    per patch in raster order, each plus its position embedding."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.side = cfg.image_size // cfg.patch_size
        self.patch_embedding = skip_init(
            nn.Conv2d,
            cfg.num_channels,
            cfg.hidden_size,
            kernel_size=cfg.patch_size,
            stride=cfg.patch_size,
            dtype=dtype,
            device=device,
        )
        self.position_embedding = skip_init(
            nn.Embedding, self.side**2, cfg.hidden_size, dtype=dtype, device=device
        )

    def forward(self, pixels: torch.Tensor, patches: torch.Tensor | None) -> torch.Tensor:
        """`patches` None: every image is image_size square, its patch i at position i (SigLIP's
        own embeddings, as Gemma 3 runs them)."""
        rows = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, patches, hidden]
        if patches is None:
            return rows + self.position_embedding.weight
        return rows + self.position_embedding(position_ids(patches, self.side))


class SiglipVisionTower(nn.Module):
    """The whole tower: embeddings, every encoder layer, the final LayerNorm."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.embeddings = SiglipEmbeddings(cfg, dtype, device)
        self.layers = nn.ModuleList(
            ClipEncoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers)
        )
        self.post_layernorm = layer_norm(cfg, dtype, device)

    def forward(self, pixels: torch.Tensor, patches: torch.Tensor | None) -> torch.Tensor:
        """pixels [N, C, H, W] in the tower's dtype, `patches` bool [N, H/p, W/p] (patch_mask;
        None: every patch real, images of image_size) -> [N, (H/p) * (W/p), hidden]: every
        patch's row, padding patches' too."""
        x = self.embeddings(pixels, patches)
        real = None if patches is None else patches.flatten(1)
        keys = None if real is None or bool(real.all()) else real  # no mask: the faster attention
        for layer in self.layers:
            x = layer(x, keys)
        return self.post_layernorm(x)
