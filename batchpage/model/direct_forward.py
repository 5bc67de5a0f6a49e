"""DirectForward: a Llama-style decoder stack run as direct calls into the CPU kernels.

On a 2-core CPU the Python around a layer's kernels is not free: module calls, each launcher's
shape checks, a fresh output tensor per op, all on one thread while the other waits. On
SmolLM2-135M in bf16 at 64 decode rows, this path took a step from 78.7 to 69.9 ms, taking turns
with the modules in one process (BENCHMARKS.md, "CPU throughput after the direct decoder
stack", which also has the perf profile that found the time). This path runs
the same kernels in the same order on the same values, so its output equals the module path's
bit for bit (tests/model/test_direct_forward.py), with:
- the weights, norms and checks gathered once, when the model is set up (`build`);
- one set of activation buffers a step, reused by every layer;
- the residual stream updated in place by add_rms_norm, which also takes the previous layer's
  MLP output (the layers' `residual` argument, folded into the buffers);
- attention still through the step's StepAttention, as the module path calls it.

It applies where every layer is a plain `DecoderLayer` (attention, a SiLU GatedMLP) whose
linears are the bf16 kernel's (Bf16DotLinear, the gate/up fused with its SiLU) and whose norms
and rope run on the CPU layer ops: Llama, Mistral, Qwen2, Qwen3 (its per-head q/k norms through
their modules, as the module path runs them) and Phi-3 models in bf16 on a CPU with
AVX512-BF16. Elsewhere (MoE layers, Gemma's own block) `build` returns None and the modules run
as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batchpage.attention.backend import StepAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.layers import Attention, DecoderLayer, GatedMLP, RMSNorm
from batchpage.model.packed_linear import Bf16DotLinear, Bf16SiluMulLinear


@dataclass(frozen=True)
class DirectLayer:
    """One layer's parameters, as the kernels take them."""

    index: int  # the layer's K/V in the pool
    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor  # bf16 [hidden]
    qkv: torch.Tensor  # int32, packed [q | k | v] (kernels/cpu_bf16_linear.py)
    qkv_bias: torch.Tensor | None  # float32 [q + 2 kv]
    o: torch.Tensor  # int32, packed
    o_bias: torch.Tensor | None  # float32 [hidden]
    gate_up: torch.Tensor  # int32, packed gated: SiLU(gate) * up comes out
    down: torch.Tensor  # int32, packed
    sliding_window: int | None
    logit_softcap: float | None
    qk_norms: tuple[RMSNorm, RMSNorm] | None  # Qwen3's per-head norms of q and k, in torch


def _direct_layer(layer: nn.Module) -> DirectLayer | None:
    """The layer's parameters, or None where this path does not apply to it."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not (
        type(attn) is Attention
        and (attn.q_norm is None) == (attn.k_norm is None)
        and attn.layer_ops is not None
        and type(mlp) is GatedMLP
        and mlp.gate_up_activated
        and all(type(n) is RMSNorm and n.layer_ops is not None for n in norms)
        and isinstance(attn.qkv_proj, Bf16DotLinear)
        and isinstance(attn.o_proj, Bf16DotLinear)
        and isinstance(mlp.gate_up_proj, Bf16SiluMulLinear)
        and isinstance(mlp.down_proj, Bf16DotLinear)
    ):
        return None
    return DirectLayer(
        attn.layer,
        norms[0].weight.detach(),
        norms[1].weight.detach(),
        attn.qkv_proj.packed,
        attn.qkv_proj.bias,
        attn.o_proj.packed,
        attn.o_proj.bias,
        mlp.gate_up_proj.packed,
        mlp.down_proj.packed,
        attn.sliding_window,
        attn.logit_softcap,
        None if attn.q_norm is None or attn.k_norm is None else (attn.q_norm, attn.k_norm),
    )


class DirectForward:
    """CausalLM.forward for the models `build` accepts: same arguments, same result."""

    def __init__(self, model: nn.Module, layers: list[DirectLayer]) -> None:
        cfg = model.config
        first = model.layers[0]
        self.embed_tokens = model.embed_tokens
        self.rotary = model.rotary
        self.layers = layers
        self.final_norm = model.norm.weight.detach()
        self.eps = first.input_layernorm.eps
        self.ops = first.input_layernorm.layer_ops.raw  # the compiled layer ops, unchecked
        self.linear = first.self_attn.qkv_proj.kernel.raw.linear  # compiled, unchecked
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden, self.intermediate = cfg.hidden_size, first.mlp.gate_up_proj.intermediate
        self.scale = first.self_attn.scale

    @classmethod
    def build(cls, model: nn.Module) -> DirectForward | None:
        """The direct path for a CausalLM that runs CausalLM.forward (the caller's to check: a
        family with its own, like Gemma's scaled embeddings, is not this stack), after
        prepack_linears and use_layer_ops; None where a layer, the final norm or the dtype is not
        one it runs."""
        if not len(model.layers) or model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        layers = [_direct_layer(layer) for layer in model.layers]
        if any(d is None for d in layers) or model.norm.layer_ops is None:
            return None
        first = model.layers[0]
        kernels = {id(m.kernel) for m in model.modules() if isinstance(m, Bf16DotLinear)}
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        if len(kernels) != 1 or any(n.eps != first.input_layernorm.eps for n in norms):
            return None
        if len({id(n.layer_ops) for n in norms}) != 1:
            return None
        direct = cls(model, [d for d in layers if d is not None])
        direct.check_shapes()
        return direct

    def check_shapes(self) -> None:
        """What the kernels would check on every call, once: every weight's packed shape
        (kernels/cpu_bf16_linear.py's layout) and dtype."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        pairs = -(-h // 2)
        for d in self.layers:
            assert d.qkv.shape == (-(-(q + 2 * kv) // 32), pairs, 32), d.qkv.shape
            assert d.o.shape == (-(-h // 32), -(-q // 2), 32), d.o.shape
            assert d.gate_up.shape == (-(-self.intermediate // 16), pairs, 32), d.gate_up.shape
            assert d.down.shape == (-(-h // 32), -(-self.intermediate // 2), 32), d.down.shape
            for w in (d.qkv, d.o, d.gate_up, d.down):
                assert w.dtype == torch.int32 and w.is_contiguous()
            for n in (d.input_norm, d.post_norm):
                assert n.shape == (h,) and n.dtype == torch.bfloat16 and n.is_contiguous()
            assert d.qkv_bias is None or d.qkv_bias.shape == (q + 2 * kv,)
            assert d.o_bias is None or d.o_bias.shape == (h,)
        assert self.final_norm.shape == (h,) and self.final_norm.is_contiguous()

    def __call__(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        meta: AttentionMetadata,
        kv: KVCache,
        attn: StepAttention,  # this step's attention, planned by the backend
    ) -> torch.Tensor:  # bf16 [T, hidden], after the final norm
        t, h, d = input_ids.shape[0], self.hidden, self.head_dim
        q_size, kv_size = self.heads * d, self.kv_heads * d
        cos, sin = self.rotary(positions, meta)  # float32 [T, 1, R/2]
        half = cos.shape[-1]
        assert 2 * half <= d and cos.dtype == torch.float32, (cos.shape, cos.dtype)
        cos, sin = cos.reshape(t, half).contiguous(), sin.reshape(t, half).contiguous()
        # The residual stream, updated in place; the embeddings are a fresh tensor of our own.
        residual = self.embed_tokens(input_ids)
        assert residual.shape == (t, h) and residual.is_contiguous()
        normed = torch.empty(t, h, dtype=torch.bfloat16)
        qkv = torch.empty(t, q_size + 2 * kv_size, dtype=torch.bfloat16)
        o = torch.empty(t, h, dtype=torch.bfloat16)
        act = torch.empty(t, self.intermediate, dtype=torch.bfloat16)
        mlp_out = torch.empty(t, h, dtype=torch.bfloat16)
        # q and k are adjacent heads of each qkv row: rope rotates both in one call, in place.
        qk = qkv[:, : q_size + kv_size].view(t, self.heads + self.kv_heads, d)
        q = qkv[:, :q_size].view(t, self.heads, d)
        k = qkv[:, q_size : q_size + kv_size].view(t, self.kv_heads, d)
        v = qkv[:, q_size + kv_size :].view(t, self.kv_heads, d)
        ops, linear, eps = self.ops, self.linear, self.eps
        for i, layer in enumerate(self.layers):
            if i == 0:
                ops.rms_norm(normed, residual, layer.input_norm, eps)
            else:  # the last layer's MLP output joins the stream
                ops.add_rms_norm(normed, residual, mlp_out, residual, layer.input_norm, eps)
            linear(qkv, normed, layer.qkv, layer.qkv_bias, False)
            q_rot, k_rot = q, k
            if layer.qk_norms is None:
                ops.rope(qk, cos, sin)
            else:  # the module path's ops: each head normed in torch, then rope on the copy
                normed_qk = torch.cat([layer.qk_norms[0](q), layer.qk_norms[1](k)], dim=1)
                ops.rope(normed_qk, cos, sin)
                q_rot, k_rot = normed_qk.split([self.heads, self.kv_heads], dim=1)
            heads = attn(
                layer.index, q_rot, k_rot, v, kv, meta, self.scale,
                sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap,
            )  # fmt: skip
            assert heads.shape == (t, self.heads, d) and heads.is_contiguous()
            linear(o, heads.view(t, q_size), layer.o, layer.o_bias, False)
            ops.add_rms_norm(normed, residual, o, residual, layer.post_norm, eps)
            linear(act, normed, layer.gate_up, None, True)
            linear(mlp_out, act, layer.down, None, False)
        out = torch.empty(t, h, dtype=torch.bfloat16)
        ops.add_rms_norm(out, residual, mlp_out, residual, self.final_norm, eps)
        return out
