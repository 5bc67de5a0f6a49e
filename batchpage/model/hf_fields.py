"""Reading the fields of a Hugging Face config.json: required keys, integers, token ids, and
rope scaling in either transformers layout. Shared by the families' config readers
(hf_config.py, gemma_config.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from batchpage.model.config import RopeScaling, UnsupportedModelError

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
MAX_SIZE = 2**31 - 1  # sizes above int32 are no real model's (and GGUF's bound too)
MAX_CONTEXT = 2**24  # positions: above any supported model; the RoPE tables grow with it


def require_keys(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if cfg.get(k) is None]
    if missing:
        raise ValueError(
            f"config.json of this {cfg.get('model_type')} checkpoint lacks {', '.join(missing)}: "
            "use the config.json that came with the model (or re-save it with save_pretrained)"
        )


def int_field(cfg: Mapping[str, Any], key: str, high: int = MAX_SIZE) -> int:
    """cfg[key] as an integer from 0 to `high` (max_position_embeddings: MAX_CONTEXT); ValueError
    naming the key otherwise, before any size is used to allocate."""
    value = cfg[key]
    if key == "max_position_embeddings":
        high = min(high, MAX_CONTEXT)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ValueError(
            f"config.json: {key} must be an integer from 0 to {high:,}, got {shown}: use the "
            "config.json that came with the model"
        )
    return value


def float_field(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """cfg[key] as a finite number > 0 (rope_theta, rms_norm_eps, partial_rotary_factor), the
    default when absent or null; ValueError naming the key otherwise."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ValueError(
            f"config.json: {key} must be a number > 0, got {shown}: use the config.json that "
            "came with the model"
        )
    return float(value)


def id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_fields(
    model_type: str, cfg: Mapping[str, Any], max_pos: int, head_dim: int
) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling with defaults resolved as HF does, partial_rotary_factor) from either
    `rope_parameters` (transformers 5) or the older top-level `rope_theta` + `rope_scaling`."""
    params: Mapping[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError("per-layer rope parameters are not implemented")
    # rope_parameters (transformers 5) first, then the top-level fields of older configs.
    theta = float_field(params, "rope_theta", float_field(cfg, "rope_theta", 10000.0))
    partial = float_field(
        params, "partial_rotary_factor", float_field(cfg, "partial_rotary_factor", 1.0)
    )
    kind = params.get("rope_type") or params.get("type") or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi-3's own names for it
    if kind not in ROPE_KINDS:
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}: batchpage implements {', '.join(ROPE_KINDS)}"
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
