"""Every rope variant against transformers' own rope functions (ROPE_INIT_FUNCTIONS), and the
rotation against HF's apply_rotary_pos_emb."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from batchpage.model.config import RopeScaling
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.rope import RotaryEmbedding, apply_rope, attention_factor, static_inv_freq
from tests.model_factory import llama_cpp_rope_freqs, step_meta

HEAD_DIM = 128  # hidden 512 / 4 heads: wide enough for every llama3 and yarn band


def llama(rope: dict, max_pos: int = 8192, **extra) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters=rope,
        **extra,
    )


def ours(hf_config):
    return model_config_from_hf(hf_config.to_dict())


STATIC = {
    "linear": llama({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama3": llama(
        dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192, rope_theta=500000.0,
        ),
        max_pos=131072,
    ),
    "yarn": llama(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
         "rope_theta": 1e6},
    ),
    "yarn_mscale_untruncated": llama(
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
         "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False,
         "beta_fast": 24, "beta_slow": 2},
        max_pos=163840,
    ),
    "yarn_attention_factor": llama(
        {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "attention_factor": 0.9},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(STATIC))
def test_static_variants_match_transformers(name):
    hf = STATIC[name]
    want, want_factor = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    cfg = ours(hf)
    torch.testing.assert_close(static_inv_freq(cfg), want, rtol=1e-6, atol=0)
    assert attention_factor(cfg.rope_scaling) == pytest.approx(want_factor, rel=1e-12)
    assert not torch.allclose(want, ROPE_INIT_FUNCTIONS["linear"](llama({"factor": 1.0}))[0])


def test_llama3_bands():
    """High frequencies kept, low ones divided by factor, the middle band blended."""
    cfg = ours(STATIC["llama3"])
    plain = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    scaled = static_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    mid = ~high & ~low
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def test_gguf_rope_freqs_reproduce_llama3():
    """llama.cpp stores llama3 scaling as per-frequency divisors; dividing by them gives HF's
    llama3 frequencies."""
    hf = STATIC["llama3"]
    divisors = tuple(llama_cpp_rope_freqs(hf.rope_parameters, HEAD_DIM).tolist())
    cfg = ours(LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0))
    gguf_cfg = replace(cfg, rope_scaling=RopeScaling("freq_factors", freq_factors=divisors))
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0]
    torch.testing.assert_close(static_inv_freq(gguf_cfg), want, rtol=1e-6, atol=0)


def phi3_longrope(partial: float = 1.0) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        pad_token_id=0,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=partial,
            short_factor=[1.0 + 0.01 * i for i in range(half)],
            long_factor=[1.0 + 0.5 * i for i in range(half)],
        ),
    )


def token_angles(rotary: RotaryEmbedding, positions: list[int], seq_len: int) -> torch.Tensor:
    """cos for tokens at `positions` of one sequence that is seq_len tokens long after the step
    (the rope reads only the positions and the sequence lengths)."""
    meta, _ = step_meta([list(range(seq_len))], [seq_len - len(positions)], [len(positions)], 1)
    return rotary(torch.tensor(positions), meta)[0][:, 0]  # [T, rot / 2]


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_switches_to_long_factors_past_the_original_length(partial):
    hf = phi3_longrope(partial)
    cfg = ours(hf)
    rotary = RotaryEmbedding(cfg, 5000, torch.device("cpu"))
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097)
    assert factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    positions = [0, 7, 4000, 4095]
    for seq_len, inv_freq in [(4096, short), (4097, long)]:
        want = torch.outer(torch.tensor(positions, dtype=torch.float32), inv_freq).cos() * factor
        torch.testing.assert_close(
            token_angles(rotary, positions, seq_len), want, rtol=0, atol=2e-6
        )


def test_dynamic_base_grows_with_the_sequence():
    hf = llama({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, max_pos=64)
    rotary = RotaryEmbedding(ours(hf), 256, torch.device("cpu"))
    positions = [0, 5, 30, 63]
    for seq_len in (64, 65, 100, 256):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=torch.tensor(seq_len))
        want = torch.outer(torch.tensor(positions, dtype=torch.float32), inv_freq).cos()
        torch.testing.assert_close(
            token_angles(rotary, positions, seq_len), want, rtol=0, atol=2e-6
        )
    assert not torch.allclose(
        token_angles(rotary, positions, 64), token_angles(rotary, positions, 256)
    )


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
def test_apply_rope_matches_transformers(partial):
    hf = phi3_longrope(partial)
    rotary = RotaryEmbedding(ours(hf), 64, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, HEAD_DIM, generator=g), torch.randn(9, 2, HEAD_DIM, generator=g)
    positions = list(range(20, 29))
    meta, pos = step_meta([list(range(29))], [20], [9], 1)
    cos, sin = rotary(pos, meta)  # [T, 1, rot / 2]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        torch.cat([cos[:, 0]] * 2, -1)[None],
        torch.cat([sin[:, 0]] * 2, -1)[None],
    )
    assert pos.tolist() == positions  # a longrope model below its original length
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k[0].transpose(0, 1))
    if partial < 1:  # the unrotated tail passes through unchanged
        rot = int(HEAD_DIM * partial)
        assert torch.equal(apply_rope(q, cos, sin)[..., rot:], q[..., rot:])
