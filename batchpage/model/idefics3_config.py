"""An Idefics3 or SmolVLM config.json (model_type "idefics3" / "smolvlm") -> the language model's
config.json and the VisionConfig of its image side.

transformers fills the keys a config.json leaves out with its config classes' defaults: the
tables below are Idefics3Config's and Idefics3VisionConfig's (SmolVLM's are the same numbers),
and the text_config's are its model type's (llava_config.TEXT_DEFAULTS); an absent text_config is
Idefics3Config's default Llama, whose rms_norm_eps is 1e-5. The vision_config's model_type is not
read: transformers builds Idefics3's own tower whatever it says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpage.model.hf_fields import int_field
from batchpage.model.llava_config import (
    config_object,
    siglip_vision_config,
    text_config_of,
    tower_sizes,
)
from batchpage.model.vision_config import VisionConfig

_TOP_DEFAULTS: dict[str, Any] = {
    "image_token_id": 128257,
    "scale_factor": 2,
    "tie_word_embeddings": False,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
_ARCHITECTURES = {
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
}


def idefics3_text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config.json, transformers' defaults filled in, with what Idefics3
    keeps at the top level: tie_word_embeddings (the top level's alone decides, as
    transformers ties the top-level model's head), the dtype, the architecture. Raises
    UnsupportedModelError for a text model or quantization batchpage does not run."""
    out = text_config_of(raw, "Idefics3")
    if raw.get("text_config") is None:
        out["rms_norm_eps"] = 1e-5  # Idefics3Config's default text model
    out["tie_word_embeddings"] = bool({**_TOP_DEFAULTS, **raw}["tie_word_embeddings"])
    default = _ARCHITECTURES.get(str(raw.get("model_type")), _ARCHITECTURES["idefics3"])
    out["architectures"] = raw.get("architectures") or [default]
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype:
        out["torch_dtype"] = dtype
    return out


def idefics3_vision_config(raw: Mapping[str, Any], vocab_size: int) -> VisionConfig:
    """The image side of an Idefics3 / SmolVLM config.json whose text model has `vocab_size`
    tokens. Raises UnsupportedModelError for an activation batchpage does not compute,
    ValueError for a malformed key (a patch grid the pixel shuffle does not divide among
    them), both naming it."""
    top = {**_TOP_DEFAULTS, **raw}
    vision = {**_VISION_DEFAULTS, **config_object(raw, "vision_config")}
    sizes = tower_sizes(vision)
    scale = int_field(top, "scale_factor")
    side = sizes["image_size"] // sizes["patch_size"]
    if not scale or not side or side % scale:
        raise ValueError(
            f"config.json: the vision tower's image_size {sizes['image_size']} makes {side} "
            f"patches of {sizes['patch_size']} per side, which scale_factor={scale} must divide"
        )
    return siglip_vision_config(
        "idefics3", vision, sizes, "Idefics3",
        image_token_id=int_field(top, "image_token_id", high=vocab_size - 1),
        tokens_per_image=(side // scale) ** 2, scale_factor=scale,
    )  # fmt: skip
