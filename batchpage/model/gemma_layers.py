"""The layers Gemma 2 and Gemma 3 change: an RMSNorm that scales by (1 + weight), a GELU-gated MLP,
attention with Gemma's own scale and q/k norms, and a block with a norm before and after each
of attention and the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig
from batchpage.model.layers import Attention, GatedMLP
from batchpage.ops.workspace import Workspace


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, then back to the model dtype (as HF does: the
    checkpoint stores the offset from 1, so a zero weight is the identity scale)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeGLUMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's `gelu_pytorch_tanh` in place of SiLU."""

    silu_gated = False

    def forward(self, x: torch.Tensor, ws: Workspace) -> torch.Tensor:  # [T, hidden] each
        gate_up = self.gate_up_proj.apply(x, ws.take("gate_up", 2 * self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        act = ws.take("act", self.intermediate)
        torch.mul(F.gelu(gate, approximate="tanh"), up, out=act)
        return self.comm.all_reduce_(self.down_proj.apply(act, ws.take("mlp_out", self.hidden)))


class GemmaAttention(Attention):
    """The shared attention (its window and logit soft-cap come from the config per layer) with
    Gemma's scale, query_pre_attn_scalar ** -0.5, and for Gemma 3 (1 + weight) norms of q and k."""

    def __init__(
        self,
        layer: int,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        qk_norm: bool = False,
    ):
        super().__init__(layer, cfg, dtype, device)
        if cfg.attn_scale is not None:
            self.scale = cfg.attn_scale
        if qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: GemmaAttention,
        mlp: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,  # this layer's rope (Gemma 3's local layers have their own)
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
        ws: Workspace,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv, attn, ws)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), ws)
        return x + self.post_feedforward_layernorm(h)
