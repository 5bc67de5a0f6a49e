"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch over a paged KV cache.

The model sees one engine step at a time: the new tokens of all scheduled sequences flattened
into T rows, with their absolute positions. Attention is delegated to an AttentionBackend, which
writes the rows' K/V into the paged pool and attends through the block tables in `meta`; the
model itself holds no per-request state.

Parameters are created uninitialized (`skip_init`): a model is only meaningful after
`load_weights`, which takes Hugging Face tensor names and fuses q/k/v and gate/up on the fly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from batchpage.attention.backend import AttentionBackend
from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [T, dim]
        # Statistics in float32, then back to the model dtype before the scale (as HF does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:  # float32 [head_dim // 2]
    # float32 throughout, like the HF reference, so both round the angles the same way.
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen < old_len / high, inv_freq, blended)
    return torch.where(wavelen > old_len / low, inv_freq / factor, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1, computed once in float32.

    Rotation is the "rotate half" (GPT-NeoX) layout that HF checkpoints use: dimension i pairs
    with i + head_dim/2. The tables are non-persistent buffers, so `.to(device)` moves them;
    pick the model dtype at construction rather than with `.to(dtype)`, which would also round
    the tables to that dtype.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(cfg).to(device)
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)  # [P, head_dim // 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [T]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, 1, head_dim // 2] each
        return self.cos[positions].float()[:, None, :], self.sin[positions].float()[:, None, :]


def apply_rope(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # float32 [T, 1, D/2]
    sin: torch.Tensor,  # float32 [T, 1, D/2]
) -> torch.Tensor:  # [T, H, D], x's dtype
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), written into one output with four ops
    (on a CPU each small op costs as much as its arithmetic)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)


def _linear(
    d_in: int, d_out: int, bias: bool, dtype: torch.dtype, device: torch.device
) -> nn.Linear:
    return skip_init(nn.Linear, d_in, d_out, bias=bias, dtype=dtype, device=device)


class Attention(nn.Module):
    def __init__(self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer = layer  # index of this layer's K/V in the pool
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # Rows [0, q) are q_proj, [q, q+kv) k_proj, [q+kv, q+2kv) v_proj: one matmul for three.
        self.qkv_proj = _linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device
        )
        self.o_proj = _linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # float32 [T, 1, head_dim // 2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent columns of qkv: rotate them in one call.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = attn(self.layer, q, k, v, kv, meta, self.scale)  # [T, num_heads, head_dim]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        # Rows [0, I) are gate_proj, [I, 2I) up_proj.
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * self.intermediate, False, dtype, device)
        self.down_proj = _linear(self.intermediate, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, layer: int, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(layer, cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF parameter name suffix -> (our fused parameter, shard index) for the fused projections.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_positions: int | None = None,
    ):
        """max_positions: size of the RoPE tables (default: cfg.max_position_embeddings); pass
        the engine's max_model_len to save memory on long-context checkpoints."""
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = cfg
        self.max_positions = max_positions or cfg.max_position_embeddings
        self.embed_tokens = skip_init(
            nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.rotary = RotaryEmbedding(cfg, self.max_positions, device)
        self.layers = nn.ModuleList(
            DecoderLayer(i, cfg, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T], absolute position of each token in its sequence
        meta: AttentionMetadata,
        kv: KVCache,
        attn: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        cos, sin = self.rotary(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, kv, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> f32 [N, V]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in a HF Llama checkpoint (`model.layers.0.self_attn.q_proj.
        weight`, `lm_head.weight`, ...) into this model, casting to its dtype and device.

        Raises ValueError on unknown names, wrong shapes, or parameters left unloaded.
        """
        params = dict(self.named_parameters())
        pending = {name: set(range(_num_shards(name))) for name in params}
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store it; we derive it from the config
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still carry the copy
            target, shard = _map_name(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for this architecture")
            dest = self._shard_view(params[target], target, shard)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            pending[target].discard(shard)
        missing = sorted(name for name, shards in pending.items() if shards)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")

    def _shard_view(self, param: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        """The rows of a fused parameter that one HF projection fills."""
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            start, size = [(0, q), (q, kv), (q + kv, kv)][shard]
            return param.narrow(0, start, size)
        if ".gate_up_proj." in name:
            size = cfg.intermediate_size
            return param.narrow(0, shard * size, size)
        return param


def _map_name(name: str) -> tuple[str, int]:
    """HF name without `model.` -> (our parameter name, shard index within it)."""
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), shard
    return name, 0


def _num_shards(name: str) -> int:
    if ".qkv_proj." in name:
        return 3
    if ".gate_up_proj." in name:
        return 2
    return 1
