"""Qwen2.5-VL's vision transformer: patches -> the language model's rows, one per
spatial_merge_size x spatial_merge_size patches.

An image reaches it as its image processor's flattened patches [t * h * w, C * T * P * P], the
patches of each merged unit consecutive (the processor's order), and its grid (t, h, w) in
patches. The tower:
- embeds each patch with one linear (the checkpoint's Conv3d, whose stride is its kernel, is a
  matmul over the flattened patch);
- reorders the merged units window by window: windows of window_size pixels a side (window_size
  / patch_size / spatial_merge_size units), in raster order of windows and of units inside each
  (the image's last row and column of windows may be smaller);
- runs pre-RMSNorm blocks of bidirectional attention with 2-D rotary positions (half of each
  head's rotary dimensions turn with the patch's row, half with its column) and a gated MLP,
  attending within each window, or within the whole image (each frame of it) in the
  full_attention_layers;
- merges each unit's patches side by side through RMSNorm and a two-layer GELU MLP, then puts
  the units back in the image's order.
Several images run as one sequence of patches whose windows and images never attend across.
Every linear is made with `layers.linear` / `merged_linear`, so `CausalLM.bind` binds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from batchpage.model.clip_vision import ACTIVATIONS
from batchpage.model.layers import RMSNorm, linear, merged_linear
from batchpage.model.vision_config import VisionConfig
from batchpage.ops.layer_ops import apply_rope
from batchpage.ops.linear import LinearOp

Grid = tuple[int, int, int]  # an image's (t, h, w) in patches

_EPS = 1e-6  # transformers' RMSNorms of this tower, fixed


class WindowLayout(NamedTuple):
    """Where each patch goes while the blocks run, for a sequence of images."""

    order: torch.Tensor  # int64 [N]: the patch (in the images' order) at each blocked row
    unorder: torch.Tensor  # int64 [N / merge**2]: each merged unit's blocked row of units
    windows: list[int]  # rows of each window, in blocked order
    frames: list[int]  # rows of each image's frame (t of them; its windows are consecutive)
    rows: torch.Tensor  # int64 [N, 2]: each blocked row's patch (row, column) in its image


def window_layout(grids: Sequence[Grid], merge: int, window_units: int) -> WindowLayout:
    """The layout of images with these grids, windows of window_units x window_units merged
    units. Grid sides must be multiples of `merge`."""
    unit = merge * merge
    order: list[np.ndarray] = []
    windows: list[int] = []
    rows: list[np.ndarray] = []
    start = 0  # the image's first merged unit
    for t, h, w in grids:
        uh, uw = h // merge, w // merge
        tt, r, c = np.indices((t, uh, uw)).reshape(3, -1)
        across = -(-uw // window_units)
        down = -(-uh // window_units)
        window = (tt * down + r // window_units) * across + c // window_units
        units = np.argsort(window, kind="stable")  # raster order kept inside each window
        order.append(start + units)
        counts = np.bincount(window, minlength=t * down * across)
        windows += [int(n) * unit for n in counts if n]
        # Each unit's patches are merge x merge, row-major: their (row, column) in the image.
        inner_r, inner_c = np.divmod(np.arange(unit), merge)
        pr = (r[units, None] * merge + inner_r).reshape(-1)
        pc = (c[units, None] * merge + inner_c).reshape(-1)
        rows.append(np.stack([pr, pc], axis=1))
        start += t * uh * uw
    units_order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    patch_order = (units_order[:, None] * unit + np.arange(unit)).reshape(-1)
    return WindowLayout(
        order=torch.from_numpy(patch_order),
        unorder=torch.from_numpy(np.argsort(units_order)),
        windows=windows,
        frames=[h * w for t, h, w in grids for _ in range(t)],
        rows=torch.from_numpy(np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)),
    )


def segment_attention(
    q: torch.Tensor,  # [S, heads, D]
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[int],  # consecutive segments of the S rows
) -> torch.Tensor:  # [S, heads, D]: each row attends to its own segment's rows
    """Bidirectional attention within each segment; segments of one length run as one batch."""
    out = torch.empty_like(q)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    sizes = np.asarray(lengths, dtype=np.int64)
    for size in np.unique(sizes).tolist():
        first = torch.from_numpy(starts[sizes == size]).to(q.device)
        index = (first[:, None] + torch.arange(size, device=q.device)).reshape(-1)
        shape = (first.numel(), size, *q.shape[1:])  # [segments, size, heads, D]
        qs, ks, vs = (x.index_select(0, index).view(shape).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # scale head_dim ** -0.5
        out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, hidden // cfg.num_heads
        self.qkv: LinearOp = linear(hidden, 3 * hidden, True, dtype, device)
        self.proj: LinearOp = linear(hidden, hidden, True, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [S, hidden]
        cos: torch.Tensor,  # float32 [S, 1, head_dim / 2]
        sin: torch.Tensor,
        segments: Sequence[int],
    ) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)
        o = segment_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, segments)
        return self.proj(o.reshape(s, -1))


class VisionMLP(nn.Module):
    """down(act(gate(x)) * up(x)), all with biases; gate and up in one matmul."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj: LinearOp = merged_linear(
            cfg.hidden_size, (cfg.intermediate_size,) * 2, True, dtype, device
        )
        self.down_proj: LinearOp = linear(
            cfg.intermediate_size, cfg.hidden_size, True, dtype, device
        )
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, _EPS, dtype, device)
        self.attn = VisionAttention(cfg, dtype, device)
        self.norm2 = RMSNorm(cfg.hidden_size, _EPS, dtype, device)
        self.mlp = VisionMLP(cfg, dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merged unit's merge**2 patches, normed and side by side -> fc2(gelu(fc1(.)))."""

    def __init__(
        self, cfg: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, _EPS, dtype, device)
        self.fc1: LinearOp = linear(self.width, self.width, True, dtype, device)
        self.fc2: LinearOp = linear(self.width, text_hidden, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N / merge**2, out]
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.width))))


class Qwen2_5VisionTower(nn.Module):
    """Patches of images [N, C * T * P * P] and their grids -> [N / merge**2, text hidden]: each
    image's merged units in its order, image after image."""

    def __init__(
        self, cfg: VisionConfig, text_hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.config = cfg
        self.patch_dim = cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.window_units = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.full = frozenset(cfg.full_attention_layers)
        self.patch_embed: LinearOp = linear(self.patch_dim, cfg.hidden_size, False, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.merger = PatchMerger(cfg, text_hidden, dtype, device)
        # float32 [head_dim / 4]: the 2-D rotary frequencies, shared by rows and columns.
        quarter = torch.arange(0, cfg.hidden_size // cfg.num_heads // 2, 2, dtype=torch.float32)
        inv_freq = 1.0 / cfg.rope_theta ** (quarter / (cfg.hidden_size // cfg.num_heads // 2))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        cfg = self.config
        layout = window_layout(grids, cfg.spatial_merge_size, self.window_units)
        device = patches.device
        x = self.patch_embed(patches.index_select(0, layout.order.to(device)))
        # Angles in float32 (as transformers): [rows * inv_freq, columns * inv_freq].
        rows = layout.rows.to(device=device, dtype=torch.float32)
        angles = (rows[:, :, None] * self.inv_freq).reshape(rows.shape[0], -1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.frames if i in self.full else layout.windows)
        return self.merger(x).index_select(0, layout.unorder.to(device))
