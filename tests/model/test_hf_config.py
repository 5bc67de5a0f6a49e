"""config.json -> ModelConfig: each family's quirks, rope parameters, layer windows, MoE layout,
and the refusals (the folder-level refusals are in test_loaders.py)."""

from __future__ import annotations

import pytest

from batchpage.model.config import UnsupportedModelError
from batchpage.model.hf_config import model_config_from_hf
from tests.model_factory import VARIANTS, build_hf_model

BASE = dict(
    vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def test_transformers4_layout():
    """Older config.json: rope_theta/rope_scaling at top level, no head_dim, eos as a list."""
    cfg = model_config_from_hf(
        {
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 131072,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "torch_dtype": "bfloat16",
        }
    )
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and cfg.family == "llama"
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.kind == "llama3"
    assert cfg.rope_scaling.original_max_position_embeddings == 8192
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.torch_dtype == "bfloat16" and not cfg.tie_word_embeddings
    assert cfg.max_model_len == 131072


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_reads_as_transformers_configures_it(variant):
    hf = build_hf_model(variant).config
    cfg = model_config_from_hf(hf.to_dict())
    assert cfg.model_type == hf.model_type
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert cfg.head_dim == (
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    )
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    kind = hf.rope_parameters["rope_type"]
    assert (cfg.rope_scaling.kind if cfg.rope_scaling else "default") == kind
    if kind in ("llama3", "yarn", "longrope"):  # HF's own resolution of the pretraining length
        want = hf.rope_parameters["original_max_position_embeddings"]
        assert cfg.rope_scaling.original_max_position_embeddings == want
    rotary = int(cfg.head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
    assert cfg.rotary_dim == rotary
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings


def test_attention_biases_per_family():
    def biases(model_type: str, **extra) -> tuple[bool, bool]:
        cfg = model_config_from_hf(dict(BASE, model_type=model_type, **extra))
        return cfg.attention_bias, cfg.o_proj_bias

    assert biases("qwen2") == (True, False)  # hard-coded by Qwen2
    assert biases("llama", attention_bias=True) == (True, True)
    assert biases("qwen3", attention_bias=True) == (True, True)
    assert biases("qwen3") == biases("mistral") == biases("phi3") == (False, False)


def test_sliding_windows_per_layer():
    def windows(model_type: str, **extra) -> tuple:
        cfg = model_config_from_hf(dict(BASE, model_type=model_type, **extra))
        return cfg.layer_windows

    assert windows("mistral", sliding_window=512) == (512,) * 4
    assert windows("phi3", sliding_window=2047) == (2047,) * 4
    assert windows("llama", sliding_window=512) == ()  # Llama has none
    assert windows("qwen2", sliding_window=512) == ()  # use_sliding_window is off
    # Qwen2/Qwen3: layers from max_window_layers on, or as layer_types says
    assert windows("qwen3", sliding_window=64, use_sliding_window=True, max_window_layers=2) == (
        None,
        None,
        64,
        64,
    )
    types = ["sliding_attention", "full_attention"] * 2
    assert windows("qwen2", sliding_window=64, use_sliding_window=True, layer_types=types) == (
        64,
        None,
        64,
        None,
    )
    cfg = model_config_from_hf(
        dict(BASE, model_type="mistral", sliding_window=512, max_position_embeddings=4096)
    )
    assert cfg.sliding_window == 512 and cfg.max_model_len == 4096  # windows cap no length


def test_moe_layout():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = model_config_from_hf(
        dict(BASE, model_type="qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3], **moe)
    )
    assert cfg.family == "qwen3_moe" and cfg.moe.sparse_layers == (False, True, False, False)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (8, 2, 16)
    assert not cfg.moe.norm_topk_prob  # HF's default
    # transformers 5 saves num_experts as num_local_experts; every layer sparse needs no
    # dense intermediate_size
    dense_free = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    saved = dict(dense_free, model_type="qwen3_moe", num_local_experts=4, num_experts_per_tok=2)
    cfg = model_config_from_hf(dict(saved, moe_intermediate_size=16, norm_topk_prob=True))
    assert cfg.moe.num_experts == 4 and all(cfg.moe.sparse_layers) and cfg.moe.norm_topk_prob
    mixtral = model_config_from_hf(
        dict(BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    )
    assert mixtral.moe.norm_topk_prob and mixtral.moe.intermediate_size == 8
    with pytest.raises(ValueError, match="lacks intermediate_size"):
        model_config_from_hf(dict(saved, moe_intermediate_size=16, decoder_sparse_step=2))


def test_context_limit_follows_the_rope_scaling():
    def limit(rope: dict | None, **extra) -> int:
        cfg = dict(BASE, model_type="llama", max_position_embeddings=4096, rope_scaling=rope)
        return model_config_from_hf({**cfg, **extra}).max_model_len

    assert limit(None) == 4096
    assert limit({"rope_type": "linear", "factor": 4.0}) == 16384
    assert limit({"rope_type": "dynamic", "factor": 2.0}) == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert limit(yarn, max_position_embeddings=40960) == 131072  # Qwen3's published setting
    llama3 = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    )  # fmt: skip
    assert limit(llama3) == 4096  # llama3 states its extended length itself


def test_phi3_rope_quirks():
    half = 8  # head_dim 16
    rope = {"type": "su", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    cfg = model_config_from_hf(
        dict(
            BASE,
            model_type="phi3",
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling=rope,
        )
    )
    s = cfg.rope_scaling
    assert s.kind == "longrope" and s.original_max_position_embeddings == 4096
    assert s.factor == 32.0 and s.long_factor == (2.0,) * half
    with pytest.raises(ValueError, match="short_factor/long_factor have 3/8 entries, need 8"):
        model_config_from_hf(
            dict(
                BASE,
                model_type="phi3",
                original_max_position_embeddings=4096,
                rope_scaling={**rope, "short_factor": [1.0] * 3},
            )
        )
    partial = model_config_from_hf(dict(BASE, model_type="phi3", partial_rotary_factor=0.75))
    assert partial.rotary_dim == 12
    with pytest.raises(ValueError, match="'longrope' needs 'original_max_position_embeddings'"):
        model_config_from_hf(dict(BASE, model_type="phi3", rope_scaling=rope))  # HF refuses too


@pytest.mark.parametrize(
    ("patch", "error", "match"),
    [
        ({"model_type": "gpt2"}, UnsupportedModelError, "unsupported model_type 'gpt2'"),
        ({"model_type": None}, UnsupportedModelError, "unsupported model_type None in config.json"),
        ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act"),
        ({"mlp_bias": True}, UnsupportedModelError, "mlp_bias"),
        ({"quantization_config": {"quant_method": "eetq"}}, UnsupportedModelError, "'eetq'"),
        ({"num_attention_heads": None}, ValueError, "lacks num_attention_heads"),
        ({"vocab_size": -1}, ValueError, "vocab_size must be an integer from 0 to"),
        ({"vocab_size": 10**10}, ValueError, "vocab_size must be an integer from 0 to 2,147,"),
        ({"max_position_embeddings": 2**40}, ValueError, "from 0 to 16,777,216, got 1099"),
        ({"hidden_size": 66}, ValueError, "not a multiple of num_attention_heads"),
        ({"num_key_value_heads": 3}, ValueError, "not a multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "linear"}}, ValueError, "'linear' needs 'factor'"),
        ({"rope_scaling": {"rope_type": "proportional"}}, UnsupportedModelError, "proportional"),
    ],
)
def test_refusals_name_the_problem(patch, error, match):
    cfg = {k: v for k, v in {**BASE, "model_type": "llama", **patch}.items()}
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "model_type"}
    with pytest.raises(error, match=match):
        model_config_from_hf(cfg)
