"""A Hugging Face config.json (transformers 4.x or 5.x layout) -> ModelConfig.

Everything a checkpoint needs that batchpage lacks is refused here, before any weight is read:
an architecture outside config.FAMILIES, a quantized checkpoint, a missing or malformed key, a
rope variant or activation that is not implemented.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from batchpage.model.config import (
    ModelConfig,
    MoEConfig,
    RopeScaling,
    UnsupportedModelError,
    family_for,
)

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_MOE_REQUIRED = {
    "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
    "mixtral": ("num_experts_per_tok", "num_local_experts", "intermediate_size"),
}
_ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def model_config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Raises UnsupportedModelError for what batchpage does not run, ValueError for a config.json
    that is incomplete or malformed; both name the fix."""
    model_type = cfg.get("model_type")
    family = family_for("hf", model_type)
    _refuse_quantized(cfg)
    if family in ("gemma2", "gemma3"):
        # gemma_config builds on this module's helpers, so it is imported here, not at the top
        from batchpage.model.gemma_config import gemma_config_from_hf

        return gemma_config_from_hf(cfg, family)
    _require(cfg, _REQUIRED + _MOE_REQUIRED.get(str(model_type), ()))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only silu is implemented")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not implemented")

    hidden, heads = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    layers = _int(cfg, "num_hidden_layers")
    head_dim = _int(cfg, "head_dim") if cfg.get("head_dim") else hidden // heads
    if not cfg.get("head_dim") and hidden % heads:
        raise ValueError(
            f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "and there is no head_dim: add the model's head_dim to config.json"
        )
    moe = _moe(str(model_type), cfg, layers)
    if moe is None or not all(moe.sparse_layers):
        _require(cfg, ("intermediate_size",))  # a dense MLP runs in some layer
    max_pos = _int(cfg, "max_position_embeddings") if "max_position_embeddings" in cfg else 2048
    theta, scaling, partial = _rope(str(model_type), cfg, max_pos, head_dim)
    qkv_bias, o_bias = _attention_biases(str(model_type), cfg)
    return ModelConfig(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size") if "intermediate_size" in cfg else 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads") if cfg.get("num_key_value_heads") else heads,
        head_dim=head_dim,
        family=family,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial),  # as HF rounds it
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
        layer_windows=_layer_windows(str(model_type), cfg, layers),
        moe=moe,
        model_type=str(model_type),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def _refuse_quantized(cfg: Mapping[str, Any]) -> None:
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, Mapping) else "unknown"
        raise UnsupportedModelError(
            f"this is a quantized checkpoint (quant_method={method!r}); batchpage loads float "
            "weights only: use the unquantized (bf16/fp16/fp32) checkpoint or a GGUF file"
        )


def _require(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ValueError(
            f"config.json of this {cfg.get('model_type')} checkpoint lacks {', '.join(missing)}: "
            "use the config.json that came with the model (or re-save it with save_pretrained)"
        )


def _int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _attention_biases(model_type: str, cfg: Mapping[str, Any]) -> tuple[bool, bool]:
    """(biases on q/k/v, bias on o_proj)."""
    if model_type == "qwen2":
        return True, False  # Qwen2 hard-codes q/k/v biases and no o_proj bias
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        bias = bool(cfg.get("attention_bias", False))
        return bias, bias
    return False, False


def _layer_windows(model_type: str, cfg: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Which layers attend through a sliding window, as HF decides for each architecture."""
    window = cfg.get("sliding_window")
    if not window or model_type == "llama":
        return ()
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        return ()
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
        windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    else:  # mistral, mixtral, phi3, qwen3_moe: every layer
        windows = (int(window),) * layers
    return windows if any(windows) else ()


def _moe(model_type: str, cfg: Mapping[str, Any], layers: int) -> MoEConfig | None:
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=_int(cfg, "num_local_experts"),
            top_k=_int(cfg, "num_experts_per_tok"),
            intermediate_size=_int(cfg, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral: softmax over the chosen experts
            sparse_layers=(True,) * layers,
        )
    if model_type != "qwen3_moe":
        return None
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    _require(cfg, (key,))
    experts, step = _int(cfg, key), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        return None
    return MoEConfig(
        num_experts=experts,
        top_k=_int(cfg, "num_experts_per_tok"),
        intermediate_size=_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _rope(
    model_type: str, cfg: Mapping[str, Any], max_pos: int, head_dim: int
) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling with defaults resolved as HF does, partial_rotary_factor) from either
    `rope_parameters` (transformers 5) or the older top-level `rope_theta` + `rope_scaling`."""
    params: Mapping[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError("per-layer rope parameters are not implemented")
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3's own names for it
    if kind not in _ROPE_KINDS:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}: batchpage implements {', '.join(_ROPE_KINDS)}"
        )
    if kind == "default":
        return theta, None, partial

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(
                f"config.json: rope scaling {kind!r} needs {key!r}: use the config.json that "
                "came with the model"
            )
        return params[key]

    original = int(params.get("original_max_position_embeddings") or max_pos)
    if model_type == "phi3" and kind in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps it at the top level, and HF prefers that
        top = cfg.get("original_max_position_embeddings")
        original = int(top or need("original_max_position_embeddings"))
    if kind in ("linear", "dynamic"):
        # dynamic scales from max_position_embeddings itself (HF ignores any "original" here)
        scaling = RopeScaling(kind, float(need("factor")), 0 if kind == "linear" else max_pos)
    elif kind == "llama3":
        scaling = RopeScaling(
            kind,
            float(need("factor")),
            original,
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
        )
    elif kind == "yarn":
        scaling = RopeScaling(
            kind,
            float(params.get("factor") or max_pos / original),
            original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
        )
    else:  # longrope
        short, long = tuple(need("short_factor")), tuple(need("long_factor"))
        rotary_half = int(head_dim * partial) // 2
        if len(short) != rotary_half or len(long) != rotary_half:
            raise ValueError(
                f"config.json: longrope short_factor/long_factor have {len(short)}/{len(long)} "
                f"entries, need {rotary_half} (half the rotary dimension)"
            )
        scaling = RopeScaling(
            kind,
            float(params.get("factor") or max_pos / original),
            original,
            attention_factor=params.get("attention_factor"),
            short_factor=tuple(float(f) for f in short),
            long_factor=tuple(float(f) for f in long),
        )
    if not math.isfinite(scaling.factor) or scaling.factor <= 0:
        raise ValueError(f"config.json: rope scaling factor must be positive, got {scaling.factor}")
    return theta, scaling, partial
