"""The layers every family composes: RMSNorm, merged projections, the gated MLP, attention over
the paged cache, and the pre-norm decoder block.

Shapes are per engine step: the new tokens of all scheduled sequences flattened into T rows.
Parameters are created uninitialized (`skip_init`); a model is only meaningful after its
`load_weights`. A parameter that several checkpoint tensors fill (q/k/v stacked into one
matmul) belongs to a module with `shard_keys` / `shard_view`, which the loader uses to copy
each tensor into its rows.

Every layer computes through its bound ops (batchpage/ops): `self.ops`, the elementwise
LayerOps (torch's until `CausalLM.bind` sets the engine's), and its linears' `apply`. Each op
writes into a buffer of the step's Workspace, and the residual stream is updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.ops.collective import Collective
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import LinearSpec
from batchpage.ops.workspace import Workspace


class UsesLayerOps(nn.Module):
    """A module that computes through LayerOps and, where it ends in a row-parallel linear
    (tensor parallelism: its input split by columns across the ranks), sums the ranks' partial
    outputs through `comm`; `CausalLM.bind` sets every one's `ops` and `comm`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = LayerOps()
        self.comm = Collective()


class RMSNorm(UsesLayerOps):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        # Inference only: the ops write into given outputs, which autograd refuses.
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim], fresh
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.ops.rms_norm(out, x, self.weight, self.eps)
        return out

    def norm_into(self, out: torch.Tensor, x: torch.Tensor) -> None:  # [T, dim] each
        self.ops.rms_norm(out, x, self.weight, self.eps)

    def add_norm_into(
        self,
        out: torch.Tensor,  # [T, dim]: the norm of the sum
        residual: torch.Tensor,  # [T, dim]: the stream, += x in place
        x: torch.Tensor,  # [T, dim]
    ) -> None:
        self.ops.add_rms_norm(out, residual, x, self.weight, self.eps)


def linear(
    d_in: int, d_out: int, bias: bool, dtype: torch.dtype, device: torch.device
) -> LoadedLinear:
    return LoadedLinear(LinearSpec(d_in, (d_out,), bias, dtype), device)


def merged_linear(
    d_in: int,
    part_sizes: Sequence[int],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    silu_gated: bool = False,
) -> LoadedLinear:
    """One matmul for several projections stacked by output rows (q/k/v, gate/up). Shard i is
    the rows of part i, so a checkpoint that stores the parts separately loads into them."""
    spec = LinearSpec(d_in, tuple(part_sizes), bias, dtype, silu_gated=silu_gated)
    return LoadedLinear(spec, device)


class GatedMLP(UsesLayerOps):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    silu_gated = True  # its activation is SiLU(gate) * up, which a linear method may fuse

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up_proj: LinearOp = merged_linear(
            hidden, (intermediate,) * 2, False, dtype, device, silu_gated=self.silu_gated
        )
        self.down_proj: LinearOp = linear(intermediate, hidden, False, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        ws: Workspace,
    ) -> torch.Tensor:  # [T, hidden]: ws's "mlp_out" buffer where the down linear fills it
        act = ws.take("act", self.intermediate)
        if self.gate_up_proj.activates:  # bound to a module that fuses the activation
            act = self.gate_up_proj.apply(x, act)
        else:
            gate_up = self.gate_up_proj.apply(x, ws.take("gate_up", 2 * self.intermediate))
            self.ops.silu_mul(act, gate_up)
        return self.comm.all_reduce_(self.down_proj.apply(act, ws.take("mlp_out", self.hidden)))


class Attention(UsesLayerOps):
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
        self.head_dim, self.hidden = cfg.head_dim, cfg.hidden_size
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # Per layer, for the backend (see attention/backend.py for their exact meaning).
        self.sliding_window = cfg.window(layer)
        self.logit_softcap = cfg.attn_logit_softcap
        self.qkv_proj: LinearOp = merged_linear(
            cfg.hidden_size,
            (self.q_size, self.kv_size, self.kv_size),
            cfg.attention_bias,
            dtype,
            device,
        )
        self.o_proj: LinearOp = linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # float32 [T, 1, rotary_dim // 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
        ws: Workspace,
    ) -> torch.Tensor:  # [T, hidden]: ws's "attn_out" buffer where the o linear fills it
        t = x.shape[0]
        qkv = self.qkv_proj.apply(x, ws.take("qkv", self.q_size + 2 * self.kv_size))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)  # [T, H + Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k are adjacent heads of qk: rotated in place in one call.
        self.ops.rope_(qk, cos, sin)
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
        out = self.o_proj.apply(o.reshape(t, self.q_size), ws.take("attn_out", self.hidden))
        return self.comm.all_reduce_(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + self_attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is one [T, hidden] tensor that every layer updates in place: a layer
    returns its MLP's output unadded, and the next layer's input norm adds it in the same call
    that normalises the sum (`RMSNorm.add_norm_into`), as vLLM's layers pass it. The sums are
    the same additions, in the same order, as HF's `residual + x`."""

    def __init__(
        self,
        cfg: ModelConfig,
        self_attn: Attention,
        mlp: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self,
        delta: torch.Tensor | None,  # [T, hidden]: the last layer's MLP output (None: layer 0)
        residual: torch.Tensor,  # [T, hidden]: the stream before delta, updated in place
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
        ws: Workspace,
    ) -> torch.Tensor:  # [T, hidden]: this MLP's output, the next layer's delta
        normed = ws.take("normed", self.hidden)
        if delta is None:
            self.input_layernorm.norm_into(normed, residual)
        else:
            self.input_layernorm.add_norm_into(normed, residual, delta)
        h = self.self_attn(normed, cos, sin, meta, kv, attn, ws)
        self.post_attention_layernorm.add_norm_into(normed, residual, h)
        return self.mlp(normed, ws)


class TiedEmbedding(UsesLayerOps):
    """A tied model's token embedding read from its head, for a head that holds the only copy
    of the table (quantized: a GGUF's Q8_0 token_embd): each lookup dequantizes the rows it
    needs, so the table is not held twice. A tensor-parallel rank's head holds vocabulary rows
    [start, start + rows): it looks up the ids it holds, as VocabShardEmbedding does."""

    def __init__(self, head: LinearOp, dtype: torch.dtype, start: int, rows: int) -> None:
        super().__init__()
        self.head, self.dtype, self.start, self.rows = head, dtype, start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, hidden]
        if self.comm.world == 1:
            return self.head.weight_rows(ids).to(self.dtype)
        local = ids - self.start
        held = (local >= 0) & (local < self.rows)
        rows = self.head.weight_rows(local.clamp(0, self.rows - 1)).to(self.dtype)
        return self.comm.all_reduce_(rows.masked_fill_(~held[:, None], 0))


class VocabShardEmbedding(UsesLayerOps):
    """A tensor-parallel rank's token embedding: rows [start, start + rows) of the table. Each
    rank looks up the ids it holds, zeroes the rest, and the sum over the ranks (`comm`) is
    every id's row."""

    def __init__(
        self, rows: int, start: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.start = start
        self.weight = nn.Parameter(
            torch.empty(rows, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # int64 [T] -> [T, hidden]
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = torch.nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.comm.all_reduce_(rows.masked_fill_(~held[:, None], 0))
