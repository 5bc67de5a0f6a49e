"""Rotary position embeddings with every rope variant the supported checkpoints use.

Static variants (default, linear, llama3, yarn, GGUF freq_factors) are one cos/sin table over
positions. Two variants also depend on how long the sequence is when a token is computed, as in
HF transformers, which picks them from the longest position of each forward pass:
- longrope (Phi-3 128k): the long factors once the sequence passes its pretraining length;
- dynamic NTK: a larger base as the sequence grows past max_position_embeddings.
Here that length is the token's sequence length at the end of its engine step (meta.seq_lens),
which equals HF's choice when a prompt is prefilled in one step and decoded token by token.

A model with M-RoPE sections (Qwen2.5-VL) takes positions [3, T] (model/mrope.py): each rotary
half-dimension's angle is from the position on its section's axis. Positions [T] are the same
position on all three axes (a text-only sequence's), which is plain RoPE.

All frequencies and tables are float32 like the HF reference, so both round the angles alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from batchpage.attention.metadata import AttentionMetadata
from batchpage.model.config import ModelConfig, RopeScaling
from batchpage.ops.layer_ops import apply_rope

__all__ = ["RotaryEmbedding", "apply_rope", "attention_factor", "static_inv_freq"]


def _exponents(dim: int) -> torch.Tensor:  # float32 [dim // 2]: 2i / dim
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:  # float32 [dim // 2]
    return 1.0 / (theta ** _exponents(dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    old_len, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen < old_len / high, inv_freq, blended)
    return torch.where(wavelen > old_len / low, inv_freq / s.factor, out)


def _yarn(theta: float, dim: int, s: RopeScaling) -> torch.Tensor:
    """Interpolate (divide by factor) the slow dimensions, extrapolate (keep) the fast ones, with
    a linear ramp between the dimensions that turn beta_fast and beta_slow times over the
    pretraining length."""

    def dim_turning(turns: float) -> float:  # the dimension index that rotates `turns` times
        return (
            dim
            * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = dim_turning(s.beta_fast), dim_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** _exponents(dim)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(s: RopeScaling | None) -> float:
    """The factor yarn and longrope apply to cos and sin (so q.k scales by its square)."""
    if s is None or s.kind not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.kind == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


def static_inv_freq(cfg: ModelConfig) -> torch.Tensor:  # float32 [rotary_dim // 2]
    """The frequencies used for every token (for longrope: its short factors; for dynamic: the
    unscaled ones, used until a sequence outgrows max_position_embeddings)."""
    theta, dim, s = cfg.rope_theta, cfg.rotary_dim, cfg.rope_scaling
    inv_freq = default_inv_freq(theta, dim)
    if s is None or s.kind == "dynamic":
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        return _llama3(inv_freq, s)
    if s.kind == "yarn":
        return _yarn(theta, dim, s)
    if s.kind == "freq_factors":
        return inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32)
    if s.kind == "longrope":
        return 1.0 / (torch.tensor(s.short_factor, dtype=torch.float32) * theta ** _exponents(dim))
    raise ValueError(f"unknown rope scaling kind {s.kind!r}")


def section_axes(sections: Sequence[int]) -> torch.Tensor:
    """int64 [sum(sections)]: the axis (0 temporal, 1 height, 2 width) each rotary
    half-dimension takes its position from: section i's dimensions take axis i % 3."""
    return torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(sections)])


def by_sections(
    table: torch.Tensor,  # [max positions, R/2]: a cos or sin table
    positions: torch.Tensor,  # int64 [3, T]
    axes: torch.Tensor,  # int64 [R/2]: section_axes, on the table's device
) -> torch.Tensor:  # [T, R/2]
    """Each token's row of `table` per half-dimension, at its position on that dimension's axis
    (transformers' mrope recomposition of the cos / sin of its three position rows)."""
    rows = torch.stack([table.index_select(0, p) for p in positions.unbind(0)])  # [3, T, R/2]
    return rows.gather(0, axes.expand(1, rows.shape[1], -1)).squeeze(0)


def _tables(inv_freq: torch.Tensor, positions: int, scale: float, device: torch.device):
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)  # [P, rot / 2]
    return (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)


class RotaryEmbedding(nn.Module):
    """cos/sin for the step's tokens: float32 [T, 1, rotary_dim // 2] each.

    Rotation is the "rotate half" (GPT-NeoX) layout that HF checkpoints use: dimension i pairs
    with i + rotary_dim/2. The tables are non-persistent float32 buffers, so `.to(device)` moves
    them and a bf16 model keeps float32 angles.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device):
        super().__init__()
        s = cfg.rope_scaling
        self.scaling = s
        self.theta, self.dim = cfg.rope_theta, cfg.rotary_dim
        scale = attention_factor(s)
        cos, sin = _tables(static_inv_freq(cfg), max_positions, scale, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if s is not None and s.kind == "longrope":
            long = 1.0 / (torch.tensor(s.long_factor) * self.theta ** _exponents(self.dim))
            long_cos, long_sin = _tables(long, max_positions, scale, device)
            self.register_buffer("long_cos", long_cos, persistent=False)
            self.register_buffer("long_sin", long_sin, persistent=False)
        self.mrope = bool(cfg.mrope_section)
        if self.mrope:  # config readers refuse the length-dependent variants with it
            axes = section_axes(cfg.mrope_section).to(device)
            self.register_buffer("axes", axes, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [T], or [3, T] for M-RoPE
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, 1, rotary_dim // 2] each
        if self.mrope and positions.dim() == 2:
            cos, sin = (
                by_sections(self.cos, positions, self.axes),
                by_sections(self.sin, positions, self.axes),
            )
            return cos[:, None, :], sin[:, None, :]
        # index_select: a plain row gather, cheaper per step than advanced indexing.
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        s = self.scaling
        if s is not None and s.kind in ("longrope", "dynamic"):
            original = s.original_max_position_embeddings
            seq_lens = _token_seq_lens(meta, positions.device)  # [T]
            long = (seq_lens > original)[:, None]
            if s.kind == "longrope":
                cos = torch.where(long, self.long_cos[positions], cos)
                sin = torch.where(long, self.long_sin[positions], sin)
            elif bool(long.any()):
                dyn_cos, dyn_sin = self._dynamic(positions, seq_lens, s)
                cos, sin = torch.where(long, dyn_cos, cos), torch.where(long, dyn_sin, sin)
        return cos[:, None, :], sin[:, None, :]

    def _dynamic(
        self, positions: torch.Tensor, seq_lens: torch.Tensor, s: RopeScaling
    ) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, rot / 2] each
        """NTK-aware scaling: base grows with the sequence length L past the original length,
        theta * (factor * L / original - (factor - 1)) ** (dim / (dim - 2))."""
        grown = seq_lens.clamp(min=s.original_max_position_embeddings).float()
        ratio = s.factor * grown / s.original_max_position_embeddings - (s.factor - 1)
        base = self.theta * ratio ** (self.dim / (self.dim - 2))  # [T]
        inv_freq = 1.0 / base[:, None] ** _exponents(self.dim).to(base.device)  # [T, rot / 2]
        freqs = positions.float()[:, None] * inv_freq
        return freqs.cos(), freqs.sin()


def _token_seq_lens(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:  # int64 [T]
    """Each token's sequence length at the end of this step."""
    lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
    repeats = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    return torch.repeat_interleave(lens, repeats).to(device)
