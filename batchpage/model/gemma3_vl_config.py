"""A Gemma 3 multimodal config.json (model_type "gemma3") -> the VisionConfig of its image side
(with_gemma3_vision; a folder without a vision_config runs its text model alone); its
text_config is read by gemma_config.py as the text model's.

transformers fills the keys a config.json leaves out with its config classes' defaults: the
tables below are Gemma3Config's and SiglipVisionConfig's. The projector average-pools the
tower's patch grid to mm_tokens_per_image rows (a square number whose side divides the grid's),
so those are checked here, before any weight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from batchpage.model.config import ModelConfig, UnsupportedModelError
from batchpage.model.hf_fields import int_field
from batchpage.model.llava_config import config_object, siglip_vision_config, tower_sizes
from batchpage.model.vision_config import VisionConfig

_TOP_DEFAULTS: dict[str, Any] = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# Gemma3Config's attribute_map: a config.json may name each token either way; the *_id wins.
_TOKEN_KEYS = (
    ("image_token_id", "image_token_index"),
    ("boi_token_id", "boi_token_index"),
    ("eoi_token_id", "eoi_token_index"),
)


def with_gemma3_vision(text: ModelConfig, raw: Mapping[str, Any]) -> ModelConfig:
    """The config of a gemma3 config.json whose text model's config is `text`: with its image
    side (family gemma3_vl), or, when it has no vision_config, its text model alone (family
    gemma3, Gemma3ForCausalLM, which skips the tower's tensors)."""
    if raw.get("vision_config") is None:
        return replace(text, family="gemma3")
    return replace(text, vision=gemma3_vision_config(raw, text.vocab_size))


def gemma3_vision_config(raw: Mapping[str, Any], vocab_size: int) -> VisionConfig:
    """The image side of a Gemma 3 config.json whose text model has `vocab_size` tokens. Raises
    UnsupportedModelError for a tower or quantization batchpage does not run, ValueError for a
    malformed key (an mm_tokens_per_image the pooling cannot make), both naming it."""
    if raw.get("quantization_config") is not None:
        raise UnsupportedModelError(
            "quantized Gemma 3 vision checkpoints are not implemented: use the checkpoint's "
            "float weights"
        )
    given = config_object(raw, "vision_config")
    kind = given.get("model_type", "siglip_vision_model")
    if kind != "siglip_vision_model":
        raise UnsupportedModelError(
            f"Gemma 3 with a {kind!r} vision tower is not implemented: batchpage runs Gemma 3 "
            "with its SigLIP tower (vision_config model_type 'siglip_vision_model')"
        )
    top = {**_TOP_DEFAULTS, **raw}
    for new, old in _TOKEN_KEYS:
        if raw.get(new) is not None:
            top[old] = raw[new]
    vision = {**_VISION_DEFAULTS, **given}
    sizes = tower_sizes(vision)
    side = sizes["image_size"] // sizes["patch_size"]
    tokens = int_field(top, "mm_tokens_per_image")
    per_side = round(tokens**0.5)
    if tokens < 1 or per_side * per_side != tokens or not side or side % per_side:
        raise ValueError(
            f"config.json: mm_tokens_per_image={tokens} must be a square whose side divides the "
            f"tower's {side} patches per side (image_size {sizes['image_size']} / patch_size "
            f"{sizes['patch_size']})"
        )
    ids = {k: int_field(top, k, high=vocab_size - 1) for _, k in _TOKEN_KEYS}
    return siglip_vision_config(
        "gemma3", vision, sizes, "Gemma 3", image_token_id=ids["boi_token_index"],
        tokens_per_image=tokens, soft_token_id=ids["image_token_index"],
        end_token_id=ids["eoi_token_index"],
    )  # fmt: skip
