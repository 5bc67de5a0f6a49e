"""A Qwen2.5-VL config.json (model_type "qwen2_5_vl") -> the language model's config.json (a
qwen2 model: q/k/v biases), its M-RoPE sections and the VisionConfig of its image side.

Both layouts transformers has written are read: 5.x nests the language model in `text_config`;
4.x (and the Hub's released folders) keeps its keys at the top level beside `vision_config`.
Absent keys take transformers' defaults (Qwen2_5_VLTextConfig's, Qwen2_5_VLVisionConfig's,
Qwen2_5_VLConfig's, tabled below). The rope type "mrope" is the default rope over 3-D positions;
the sections default to transformers' [16, 24, 24].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpage.model.config import UnsupportedModelError
from batchpage.model.hf_fields import float_field, int_field
from batchpage.model.llava_config import activation, config_object
from batchpage.model.vision_config import VisionConfig

_TOP_DEFAULTS: dict[str, Any] = {
    "image_token_id": 151655,
    "tie_word_embeddings": False,
}
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 80,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_ROPE_THETA = 1000000.0  # Qwen2_5_VLTextConfig's default_theta
_MROPE_SECTION = (16, 24, 24)  # what transformers' rotary embedding takes when none is given
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": (7, 15, 23, 31),
}
# Keys of a 4.x flat config.json that are the whole model's, not its language model's.
_TOP_ONLY = (
    "text_config",
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "architectures",
    "model_type",
)


def _text_keys(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's keys as written: 5.x's text_config, or 4.x's top level."""
    if raw.get("text_config") is not None:
        return config_object(raw, "text_config")
    return {k: v for k, v in raw.items() if k not in _TOP_ONLY}


def _rope(text: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the rope parameters as a plain qwen2 model's, mrope_section)."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError("config.json: rope_parameters must be an object")
    kind = params.get("rope_type") or params.get("type") or "default"
    kind = "default" if kind == "mrope" else kind
    if kind in ("dynamic", "longrope"):
        raise UnsupportedModelError(
            f"rope scaling {kind!r} with M-RoPE is not implemented: batchpage runs Qwen2.5-VL "
            "with a static rope (default, linear, yarn, llama3)"
        )
    section = params.get("mrope_section") or _MROPE_SECTION
    if not isinstance(section, list | tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in section
    ):
        raise ValueError(f"config.json: mrope_section must be a list of integers, got {section!r}")
    theta = float_field(params, "rope_theta", float_field(text, "rope_theta", _ROPE_THETA))
    plain = {k: v for k, v in params.items() if k not in ("type", "rope_type", "mrope_section")}
    return {**plain, "rope_type": kind, "rope_theta": theta}, tuple(section)


def qwen2_5_vl_text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config.json (model_type qwen2), transformers' defaults filled in,
    with the top level's tie_word_embeddings (either level ties, as transformers 5 forwards a
    4.x text_config's), dtype and architecture. Raises UnsupportedModelError for a quantized
    checkpoint or a rope batchpage does not run with M-RoPE."""
    if raw.get("quantization_config") is not None:
        raise UnsupportedModelError(
            "quantized Qwen2.5-VL checkpoints are not implemented: use the checkpoint's float "
            "weights"
        )
    text = _text_keys(raw)
    rope, _ = _rope(text)
    out = {**_TEXT_DEFAULTS, **text, "model_type": "qwen2", "rope_parameters": rope}
    out.pop("rope_scaling", None)
    out.pop("head_dim", None)  # transformers' Qwen2.5-VL attention takes hidden / heads
    tie = {**_TOP_DEFAULTS, **raw}["tie_word_embeddings"] or text.get("tie_word_embeddings")
    out["tie_word_embeddings"] = bool(tie)
    out["architectures"] = raw.get("architectures") or ["Qwen2_5_VLForConditionalGeneration"]
    dtype = raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype")
    if dtype:
        out["torch_dtype"] = dtype
    return out


def mrope_section(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """The M-RoPE sections of a Qwen2.5-VL config.json (ModelConfig checks that they sum to half
    the rotary dimension)."""
    return _rope(_text_keys(raw))[1]


def qwen2_5_vl_vision_config(raw: Mapping[str, Any], vocab_size: int) -> VisionConfig:
    """The image side of a Qwen2.5-VL config.json whose text model has `vocab_size` tokens.
    Raises UnsupportedModelError for an activation batchpage does not compute, ValueError for a
    malformed key or sizes the tower cannot run (naming them)."""
    top = {**_TOP_DEFAULTS, **raw}
    vision = {**_VISION_DEFAULTS, **config_object(raw, "vision_config")}
    keys = (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "in_channels",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "window_size",
        "out_hidden_size",
    )
    sizes = {k: int_field(vision, k) for k in keys}
    bad = [f"{k}={v}" for k, v in sizes.items() if v <= 0 and k != "depth"]
    heads, hidden = sizes["num_heads"], sizes["hidden_size"]
    if bad or hidden % heads or (hidden // heads) % 4:
        raise ValueError(
            "config.json: vision_config sizes must be positive with hidden_size / num_heads a "
            f"multiple of 4 (the 2-D rotary halves), got {', '.join(bad) or sizes}"
        )
    merge, patch = sizes["spatial_merge_size"], sizes["patch_size"]
    if sizes["window_size"] < merge * patch:
        raise ValueError(
            f"config.json: vision_config window_size={sizes['window_size']} is less than one "
            f"merged unit (spatial_merge_size x patch_size = {merge * patch} pixels)"
        )
    text_hidden = int_field({**_TEXT_DEFAULTS, **_text_keys(raw)}, "hidden_size")
    if sizes["out_hidden_size"] != text_hidden:
        raise ValueError(
            f"config.json: vision_config out_hidden_size={sizes['out_hidden_size']} must be the "
            f"language model's hidden_size={text_hidden} (the merger's rows are its inputs)"
        )
    full = vision["fullatt_block_indexes"]
    if not isinstance(full, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in full
    ):
        raise ValueError(
            f"config.json: vision_config fullatt_block_indexes must be a list of layer "
            f"indices, got {full!r}"
        )
    rope = config_object(vision, "rope_parameters")
    return VisionConfig(
        kind="qwen2_5_vl",
        hidden_size=hidden,
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["depth"],
        num_heads=heads,
        image_size=merge * patch,  # no fixed size: one merged unit's pixels
        patch_size=patch,
        num_channels=sizes["in_channels"],
        layer_norm_eps=1e-6,  # transformers' RMSNorms of the tower, fixed
        hidden_act=activation(vision, "hidden_act", "Qwen2.5-VL"),
        projector_act="gelu",  # the patch merger's MLP
        projector_bias=True,
        feature_layer=(-1,),
        feature_select="full",
        image_token_id=int_field(top, "image_token_id", high=vocab_size - 1),
        tokens_per_image=1,
        spatial_merge_size=merge,
        temporal_patch_size=sizes["temporal_patch_size"],
        window_size=sizes["window_size"],
        full_attention_layers=tuple(int(i) for i in full),
        rope_theta=float_field(rope, "rope_theta", 10000.0),
    )
