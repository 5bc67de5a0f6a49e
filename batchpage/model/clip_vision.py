"""CLIP's vision transformer, as LLaVA uses it: patch convolution, a class embedding and learned
position embeddings, a pre-norm, then pre-LayerNorm encoder layers of bidirectional multi-head
attention and an MLP, all with biases.

It returns the hidden states LLaVA's `vision_feature_layer` picks, and holds only the layers up
to the deepest of them: HF runs every layer and the final `post_layernorm`, whose outputs LLaVA
never reads, so their tensors are not loaded (llava.py skips them by name). The linears are made
with `layers.linear` / `merged_linear`, so `CausalLM.bind` gives them the engine's linear
method like every other linear; q/k/v are one matmul (their checkpoint tensors load as its
parts through the Llama family's renames). SigLIP's encoder layers (Idefics3's tower,
siglip_vision.py) are these layers, with a mask over padding patches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from batchpage.model.layers import linear, merged_linear
from batchpage.model.vision_config import VisionConfig
from batchpage.ops.linear import LinearOp

Activation = Callable[[torch.Tensor], torch.Tensor]

# The activations a vision config may name, as transformers' ACT2FN computes them.
ACTIVATIONS: dict[str, Activation] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "linear": lambda x: x,  # transformers' name for no activation
}


class ClipEmbeddings(nn.Module):
    """Pixels [N, C, S, S] -> [N, 1 + patches, hidden]: the class row, then one row per patch in
    raster order, each plus its learned position embedding."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.image_size, hidden = cfg.image_size, cfg.hidden_size
        positions = (cfg.image_size // cfg.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(
            torch.empty(hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.patch_embedding = skip_init(
            nn.Conv2d,
            cfg.num_channels,
            hidden,
            kernel_size=cfg.patch_size,
            stride=cfg.patch_size,
            bias=False,
            dtype=dtype,
            device=device,
        )
        self.position_embedding = skip_init(
            nn.Embedding, positions, hidden, dtype=dtype, device=device
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, patches, hidden]
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's rows, q/k/v in one matmul; `keys`
    (bool [N, S], optional) marks the rows every row may attend to (False: padding)."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, hidden // cfg.num_heads
        self.qkv_proj: LinearOp = merged_linear(hidden, (hidden,) * 3, True, dtype, device)
        self.out_proj: LinearOp = linear(hidden, hidden, True, dtype, device)

    def forward(  # [N, S, hidden] -> [N, S, hidden]
        self, x: torch.Tensor, keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        n, s, hidden = x.shape
        qkv = self.qkv_proj(x).view(n, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, S, head_dim]
        mask = None if keys is None else keys[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # scale head_dim ** -0.5
        return self.out_proj(o.transpose(1, 2).reshape(n, s, hidden))


class ClipMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.fc1: LinearOp = linear(cfg.hidden_size, cfg.intermediate_size, True, dtype, device)
        self.fc2: LinearOp = linear(cfg.intermediate_size, cfg.hidden_size, True, dtype, device)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def layer_norm(cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> nn.LayerNorm:
    return skip_init(
        nn.LayerNorm, cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype, device=device
    )


class ClipEncoderLayer(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_norm1 = layer_norm(cfg, dtype, device)
        self.self_attn = ClipAttention(cfg, dtype, device)
        self.layer_norm2 = layer_norm(cfg, dtype, device)
        self.mlp = ClipMLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), keys)
        return x + self.mlp(self.layer_norm2(x))


class ClipVisionTower(nn.Module):
    """The tower up to the deepest layer `cfg.feature_layer` selects (`depth` layers)."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.selected = cfg.selected_layers
        self.depth = max(self.selected)
        self.embeddings = ClipEmbeddings(cfg, dtype, device)
        self.pre_layrnorm = layer_norm(cfg, dtype, device)  # sic: the checkpoints' name
        self.layers = nn.ModuleList(ClipEncoderLayer(cfg, dtype, device) for _ in range(self.depth))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """pixels [N, C, S, S] in the tower's dtype -> the selected hidden states, each
        [N, 1 + patches, hidden], in `feature_layer` order."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return [states[i] for i in self.selected]
