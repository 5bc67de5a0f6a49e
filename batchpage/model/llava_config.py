"""A LLaVA config.json (model_type "llava") -> the language model's config.json and the
VisionConfig of its image side.

transformers fills every key a LLaVA config.json leaves out with its config classes' defaults,
and released checkpoints rely on it (llava-1.5's text_config states little more than its
vocabulary): the tables below are those defaults (LlavaConfig, CLIPVisionConfig, and the
LlamaConfig / MistralConfig / Qwen2Config of the text_config), for the keys batchpage reads. A
vision_config given as an object takes CLIPVisionConfig's defaults; an absent one is LlavaConfig's
own default tower (CLIP ViT-L/14 at 336 pixels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpage.model.clip_vision import ACTIVATIONS
from batchpage.model.config import UnsupportedModelError, family_for
from batchpage.model.hf_fields import float_field, int_field
from batchpage.model.vision_config import VisionConfig

TEXT_TYPES = ("llama", "mistral", "qwen2")  # the text models LLaVA's class runs (Llama's blocks)
FEATURE_SELECT = ("default", "full")

_LLAVA_DEFAULTS: dict[str, Any] = {
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_select_strategy": "default",
    "vision_feature_layer": -2,
    "multimodal_projector_bias": True,
    "tie_word_embeddings": False,
}
_CLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
# LlavaConfig's tower when config.json has no vision_config.
_LLAVA_TOWER: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
_TEXT_COMMON: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_TEXT_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        **_TEXT_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_TEXT_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
}


def text_config_of(raw: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The text_config of a vision-language config.json (`label`, its family's name for
    messages) with transformers' defaults for its model_type (llama when absent) filled in.
    Raises UnsupportedModelError for a quantized checkpoint or a text model that is not one of
    TEXT_TYPES."""
    if raw.get("quantization_config") is not None:
        raise UnsupportedModelError(
            f"quantized {label} checkpoints are not implemented: use the checkpoint's float weights"
        )
    text = config_object(raw, "text_config")
    model_type = str(text.get("model_type", "llama"))
    if model_type not in TEXT_TYPES or family_for("hf", model_type) != "llama":
        raise UnsupportedModelError(
            f"{label} with a {model_type!r} text model is not implemented: batchpage runs "
            f"{label} with a {', '.join(TEXT_TYPES)} text_config"
        )
    return {**TEXT_DEFAULTS[model_type], **text, "model_type": model_type}


def llava_text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config.json, transformers' defaults filled in, with what LLaVA keeps
    at the top level (tie_word_embeddings, the dtype, the architecture). Raises
    UnsupportedModelError for a text model or quantization batchpage does not run as LLaVA's."""
    out = text_config_of(raw, "LLaVA")
    top = {**_LLAVA_DEFAULTS, **raw}
    # LlavaConfig ties when either level says so.
    out["tie_word_embeddings"] = bool(top["tie_word_embeddings"]) or bool(
        out["tie_word_embeddings"]
    )
    out["architectures"] = raw.get("architectures") or ["LlavaForConditionalGeneration"]
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype:
        out["torch_dtype"] = dtype
    return out


def llava_vision_config(raw: Mapping[str, Any], vocab_size: int) -> VisionConfig:
    """The image side of a LLaVA config.json whose text model has `vocab_size` tokens. Raises
    UnsupportedModelError for a vision tower batchpage does not run, ValueError for a malformed
    key, both naming it."""
    top = {**_LLAVA_DEFAULTS, **raw}
    given = raw.get("vision_config")
    kind = config_object(raw, "vision_config").get("model_type", "clip_vision_model")
    if kind != "clip_vision_model":
        raise UnsupportedModelError(
            f"LLaVA with a {kind!r} vision tower is not implemented: batchpage runs LLaVA with a "
            "CLIP tower (vision_config model_type 'clip_vision_model')"
        )
    vision = {**_CLIP_DEFAULTS, **(given if given is not None else _LLAVA_TOWER)}
    hidden_act = activation(vision, "hidden_act", "LLaVA")
    projector_act = activation(top, "projector_hidden_act", "LLaVA")
    sizes = tower_sizes(vision)
    layers = sizes["num_hidden_layers"]
    feature_layer = _feature_layers(top["vision_feature_layer"], layers)
    select = top["vision_feature_select_strategy"]
    if select not in FEATURE_SELECT:
        raise ValueError(
            f"config.json: vision_feature_select_strategy must be one of {FEATURE_SELECT}, got "
            f"{select!r}"
        )
    # transformers maps image_token_id onto image_token_index, and the former wins.
    token_key = "image_token_id" if raw.get("image_token_id") is not None else "image_token_index"
    image_token = int_field(top, token_key, high=vocab_size - 1)  # its embedding is looked up
    patches = (sizes["image_size"] // sizes["patch_size"]) ** 2
    return VisionConfig(
        kind="clip",
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=layers,
        num_heads=sizes["num_attention_heads"],
        image_size=sizes["image_size"],
        patch_size=sizes["patch_size"],
        num_channels=sizes["num_channels"],
        layer_norm_eps=float_field(vision, "layer_norm_eps", 1e-5),
        hidden_act=hidden_act,
        projector_act=projector_act,
        projector_bias=bool(top["multimodal_projector_bias"]),
        feature_layer=feature_layer,
        feature_select=select,
        image_token_id=image_token,
        tokens_per_image=patches + (select == "full"),
    )


def siglip_vision_config(
    kind: str, vision: Mapping[str, Any], sizes: Mapping[str, int], who: str, **image: Any
) -> VisionConfig:
    """The VisionConfig of a SigLIP tower whose every row is a feature (Idefics3 / SmolVLM,
    Gemma 3): `vision` its vision_config (defaults filled in), `sizes` its tower_sizes, `who`
    the family for error messages, `image` the family's placeholder and projector fields
    (image_token_id, tokens_per_image, ...)."""
    return VisionConfig(
        kind=kind,
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=sizes["num_attention_heads"],
        image_size=sizes["image_size"],
        patch_size=sizes["patch_size"],
        num_channels=sizes["num_channels"],
        layer_norm_eps=float_field(vision, "layer_norm_eps", 1e-6),
        hidden_act=activation(vision, "hidden_act", who),
        projector_act="linear",
        projector_bias=False,
        feature_layer=(-1,),
        feature_select="full",
        **image,
    )


def tower_sizes(vision: Mapping[str, Any]) -> dict[str, int]:
    """A vision_config's sizes (its defaults filled in); ValueError unless they are positive
    (layers may be 0) with hidden_size a multiple of num_attention_heads."""
    sizes = {
        k: int_field(vision, k)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_channels",
            "image_size",
            "patch_size",
        )
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v <= 0 and k != "num_hidden_layers"]
    if bad or sizes["hidden_size"] % sizes["num_attention_heads"]:
        raise ValueError(
            f"config.json: vision_config sizes must be positive with hidden_size a multiple of "
            f"num_attention_heads, got {', '.join(bad) or sizes}"
        )
    return sizes


def config_object(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """raw[key] as an object; {} when absent or null (transformers' defaults apply)."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"config.json: {key} must be an object, got {type(value).__name__}: use the "
            "config.json that came with the model"
        )
    return value


def activation(cfg: Mapping[str, Any], key: str, label: str) -> str:
    """cfg[key], an activation ACTIVATIONS computes; UnsupportedModelError naming it and the
    `label` family's config otherwise."""
    act = cfg[key]
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"unsupported {key} {act!r} in a {label} config: batchpage implements "
            f"{', '.join(ACTIVATIONS)}"
        )
    return str(act)


def _feature_layers(value: Any, layers: int) -> tuple[int, ...]:
    """vision_feature_layer as a tuple, each an index into the tower's layers + 1 hidden
    states."""
    picked = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    ok = isinstance(picked, list | tuple) and picked
    if ok:
        ok = all(
            isinstance(i, int) and not isinstance(i, bool) and -(layers + 1) <= i <= layers
            for i in picked
        )
    if not ok:
        raise ValueError(
            f"config.json: vision_feature_layer must be an index into the vision tower's "
            f"{layers + 1} hidden states (from {-(layers + 1)} to {layers}) or a list of them, "
            f"got {value!r}"
        )
    return tuple(int(i) for i in picked)
