"""The layers every family composes: RMSNorm, merged projections, the gated MLP, attention over
the paged cache, and the pre-norm decoder block.

Shapes are per engine step: the new tokens of all scheduled sequences flattened into T rows.
Parameters are created uninitialized (`skip_init`); a model is only meaningful after its
`load_weights`. A parameter that several checkpoint tensors fill (q/k/v stacked into one
matmul) belongs to a module with `shard_keys` / `shard_view`, which the loader uses to copy
each tensor into its rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig
from batchpage.model.rope import apply_rope

if TYPE_CHECKING:
    from batchpage.kernels.cpu_layer_ops import CpuLayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.layer_ops: CpuLayerOps | None = None  # set by CausalLM.use_layer_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if self.layer_ops is not None and x.dim() == 2:
            return self.layer_ops.rms_norm(x, self.weight, self.eps)
        # Statistics in float32, then back to the model dtype before the scale (as HF does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(
        self,
        x: torch.Tensor,  # [T, dim]
        residual: torch.Tensor,  # [T, dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x + residual, its norm), [T, dim] each
        if self.layer_ops is not None:
            return self.layer_ops.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


def linear(
    d_in: int, d_out: int, bias: bool, dtype: torch.dtype, device: torch.device
) -> nn.Linear:
    return skip_init(nn.Linear, d_in, d_out, bias=bias, dtype=dtype, device=device)


class MergedLinear(nn.Linear):
    """One matmul for several projections stacked by output rows (q/k/v, gate/up). Shard i is
    the rows of part i, so a checkpoint that stores the parts separately loads into them."""

    def __init__(
        self,
        d_in: int,
        part_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(d_in, sum(part_sizes), bias=bias, dtype=dtype, device=device)
        self.part_sizes = tuple(part_sizes)

    def shard_keys(self, leaf: str) -> list[Hashable]:
        return list(range(len(self.part_sizes)))

    def shard_view(self, leaf: str, key: Hashable) -> torch.Tensor:
        assert isinstance(key, int)
        start = sum(self.part_sizes[:key])
        return getattr(self, leaf).narrow(0, start, self.part_sizes[key])


def merged_linear(
    d_in: int, part_sizes: Sequence[int], bias: bool, dtype: torch.dtype, device: torch.device
) -> MergedLinear:
    return skip_init(MergedLinear, d_in, part_sizes, bias, dtype=dtype, device=device)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    silu_gated = True  # its activation is SiLU(gate) * up, which a packed gate/up may fuse

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = merged_linear(hidden, (intermediate,) * 2, False, dtype, device)
        self.down_proj = linear(intermediate, hidden, False, dtype, device)
        self.layer_ops: CpuLayerOps | None = None  # set by CausalLM.use_layer_ops
        # Set by CausalLM.prepack_linears when gate_up_proj returns SiLU(gate) * up itself.
        self.gate_up_activated = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)
        if self.gate_up_activated:
            return self.down_proj(gate_up)
        if self.layer_ops is not None:
            return self.down_proj(self.layer_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """q/k/v in one matmul, optional per-head RMSNorm of q and k (Qwen3), rope, then the backend
    writes K/V into the paged pool and attends through the block tables in `meta`."""

    def __init__(
        self,
        layer: int,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.layer = layer  # index of this layer's K/V in the pool
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # Per layer, for the backend (see attention/backend.py for their exact meaning).
        self.sliding_window = cfg.window(layer)
        self.logit_softcap = cfg.attn_logit_softcap
        self.qkv_proj = merged_linear(
            cfg.hidden_size,
            (self.q_size, self.kv_size, self.kv_size),
            cfg.attention_bias,
            dtype,
            device,
        )
        self.o_proj = linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        self.layer_ops: CpuLayerOps | None = None  # set by CausalLM.use_layer_ops (rope)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # float32 [T, 1, rotary_dim // 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)  # [T, H + Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k are adjacent heads of qk: rotate them in one call (in place in qkv's rows with
        # the CPU ops).
        qk = (
            apply_rope(qk, cos, sin)
            if self.layer_ops is None
            else self.layer_ops.rope_(qk, cos, sin)
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = attn(  # [T, num_heads, head_dim]
            self.layer,
            q,
            k,
            v,
            kv,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
        return self.o_proj(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + self_attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the layer's output, as vLLM's layers pass it: a layer
    returns its MLP's output unadded, and the next layer's input norm adds it in the same call
    that normalises the sum (`RMSNorm.add_norm`), so every residual add rides on a norm. The
    sums are the same bf16 additions, in the same order, as adding in place."""

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: Attention,
        mlp: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the last layer's MLP output, or the embeddings
        residual: torch.Tensor | None,  # [T, hidden]: the stream before x (None: layer 0)
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this MLP's output, the stream before it)
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            residual, normed = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(normed, cos, sin, meta, kv, attn)
        residual, normed = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(normed), residual
