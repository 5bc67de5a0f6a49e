"""Gemma 2 and Gemma 3 configs -> ModelConfig, from a HF config.json or a GGUF header.

HF: `gemma2`, `gemma3_text`, and `gemma3` (the multimodal folder, whose `text_config` is the
text model's). transformers fills every key a Gemma config.json leaves out with its config
class's defaults, and the Gemma 3 multimodal checkpoints rely on that: their text_config states
only what differs. The layer pattern is `layer_types`, else Gemma 2's alternation or Gemma 3's
`sliding_window_pattern`. Gemma 3's rope comes per layer type (`rope_parameters` of transformers
5) or as `rope_theta` + `rope_scaling` for the global layers and `rope_local_base_freq` for the
local ones (transformers 4).

GGUF: llama.cpp stores no layer pattern, query_pre_attn_scalar or local rope base for Gemma; it
derives them as its loader does (llama-model.cpp), and so do we.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from batchpage.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from batchpage.model.hf_fields import id_tuple, int_field, require_keys, rope_fields

GEMMA_FAMILIES = ("gemma2", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' Gemma2Config / Gemma3TextConfig defaults for the keys configs leave out. The
# sizes that differ between released models stay required.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "vocab_size": 256000,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "gemma3_text": {
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers")
_ACTIVATION = "gelu_pytorch_tanh"

# llama.cpp's GGUF tensor names where Gemma's block differs from Llama's.
GGUF_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gemma_config_from_hf(raw: Mapping[str, Any], family: str) -> ModelConfig:
    """Raises UnsupportedModelError / ValueError naming the problem and the fix."""
    cfg = _text_config(raw)
    model_type, multimodal = str(cfg["model_type"]), raw.get("model_type") == "gemma3"
    require_keys(cfg, _REQUIRED)
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "use_bidirectional_attention=True is an embedding model's config: batchpage runs "
            "causal Gemma models; use the causal checkpoint"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act != _ACTIVATION:
        raise UnsupportedModelError(
            f"unsupported hidden_activation {act!r} for {model_type}: only {_ACTIVATION} is "
            "implemented"
        )
    layers, head_dim = int_field(cfg, "num_hidden_layers"), int_field(cfg, "head_dim")
    max_pos = int_field(cfg, "max_position_embeddings")
    if model_type == "gemma2":
        theta, scaling, partial = rope_fields(model_type, cfg, max_pos, head_dim)
        local_theta, attn_cap = None, _cap(cfg, "attn_logit_softcapping")
    else:
        theta, scaling, partial, local_theta = _gemma3_rope(cfg, max_pos, head_dim)
        attn_cap = None  # HF's Gemma 3 attention does not apply attn_logit_softcapping
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int_field(cfg, "vocab_size"),
        hidden_size=int_field(cfg, "hidden_size"),
        intermediate_size=int_field(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=int_field(cfg, "num_attention_heads"),
        num_kv_heads=int_field(cfg, "num_key_value_heads"),
        head_dim=head_dim,
        family=family,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=_scaling_within(scaling, max_pos) if model_type != "gemma2" else scaling,
        rotary_dim=int(head_dim * partial),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        attention_bias=bias,
        o_proj_bias=bias,
        bos_token_id=raw.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=id_tuple(raw.get("eos_token_id", cfg.get("eos_token_id"))),
        layer_windows=_hf_windows(cfg, model_type, layers),
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attn_logit_softcap=attn_cap,
        # HF's multimodal Gemma 3 model does not apply its text_config's final soft-cap
        final_logit_softcap=None if multimodal else _cap(cfg, "final_logit_softcapping"),
        local_rope_theta=local_theta,
        model_type=model_type,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or cfg.get("torch_dtype"),
    )


def _text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config with transformers' defaults filled in."""
    if raw.get("model_type") == "gemma3":
        text = raw.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError(
                "config.json of this gemma3 checkpoint has no text_config: use the config.json "
                "that came with the model"
            )
        raw = {**text, "model_type": "gemma3_text"}
    # a key set to null stays null, as in transformers (final_logit_softcapping: null)
    cfg = {**_HF_DEFAULTS[str(raw["model_type"])], **raw}
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = int_field(cfg, "hidden_size") // int_field(cfg, "num_attention_heads")
    return cfg


def _cap(cfg: Mapping[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    if value is None or value == 0:
        return None
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config.json: {key} must be a positive number or null, got {value!r}")
    return float(value)


def _hf_windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        period = 2 if model_type == "gemma2" else int_field(cfg, "sliding_window_pattern")
        types = [SLIDING if (i + 1) % period else FULL for i in range(layers)] if period else []
    if len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(
            f"config.json: layer_types must list {SLIDING!r} or {FULL!r} for each of the "
            f"{layers} layers, got {types!r}"
        )
    if SLIDING in types and not window:
        raise UnsupportedModelError(
            f"config.json: {model_type} layers of type {SLIDING!r} without a sliding_window: "
            "set the model's sliding_window"
        )
    windows = tuple(int_field(cfg, "sliding_window") if t == SLIDING else None for t in types)
    return windows if any(windows) else ()


def _gemma3_rope(
    cfg: Mapping[str, Any], max_pos: int, head_dim: int
) -> tuple[float, RopeScaling | None, float, float]:
    """(global theta, global scaling, partial rotary factor, local theta)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values()):
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:  # transformers 4: the scaling is the global layers'
        full = dict(params or cfg.get("rope_scaling") or {})
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    if (local.get("rope_type") or local.get("type") or "default") != "default":
        raise UnsupportedModelError(
            f"rope scaling on Gemma 3's sliding-window layers ({local}) is not implemented"
        )
    flat = {"rope_parameters": full, "partial_rotary_factor": cfg.get("partial_rotary_factor")}
    theta, scaling, partial = rope_fields("gemma3_text", flat, max_pos, head_dim)
    return theta, scaling, partial, float(local.get("rope_theta") or 10000.0)


def _scaling_within(scaling: RopeScaling | None, max_pos: int) -> RopeScaling | None:
    """Gemma 3's max_position_embeddings already counts its linear scaling (131072 with factor
    8 on the 4B-27B models), so the scaling extends nothing past it."""
    if scaling is None or scaling.kind != "linear":
        return scaling
    return replace(scaling, original_max_position_embeddings=int(max_pos / scaling.factor))


def gemma_gguf_config(cfg: ModelConfig, key: Callable[..., Any]) -> ModelConfig:
    """The Gemma parts of a GGUF's config, read as llama.cpp reads them: Gemma 2 alternates
    windowed and global layers (window 4096 unless stated) and soft-caps at 50 / 30 unless
    stated; Gemma 3 has five windowed layers per global one, each with rope base
    `rope.freq_base_swa` (10000 unless stated) and no rope scaling, and no attention soft-cap.
    The attention scale is head_dim ** -0.5 except on the 27B models (46 and 62 layers), whose
    query_pre_attn_scalar is hidden / heads."""
    layers = cfg.num_layers
    if cfg.family == "gemma2":
        window, period, largest = int(key("attention.sliding_window") or 4096), 2, 46
        attn_cap = float(key("attn_logit_softcapping", 50.0))
        final_cap: float | None = float(key("final_logit_softcapping", 30.0))
        local_theta = None
    else:
        window, period, largest = int(key("attention.sliding_window") or 0), 6, 62
        attn_cap = None
        final_cap = float(key("final_logit_softcapping") or 0) or None
        local_theta = float(key("rope.freq_base_swa") or 10000.0) if window else None
    windows = (
        tuple(window if i % period < period - 1 else None for i in range(layers)) if window else ()
    )
    scalar = cfg.hidden_size // cfg.num_heads if layers == largest else cfg.head_dim
    return replace(
        cfg,
        layer_windows=windows,
        attn_scale=float(scalar) ** -0.5,
        attn_logit_softcap=attn_cap or None,
        final_logit_softcap=final_cap or None,
        local_rope_theta=local_theta,
        rope_scaling=(
            cfg.rope_scaling
            if cfg.family == "gemma2"
            else _scaling_within(cfg.rope_scaling, cfg.max_position_embeddings)
        ),
    )
