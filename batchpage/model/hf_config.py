"""A Hugging Face config.json (transformers 4.x or 5.x layout) -> ModelConfig.

Everything a checkpoint needs that batchpage lacks is refused here, before any weight is read:
an architecture outside config.FAMILIES, a quantization scheme batchpage/quant does not run, a
missing or malformed key, a rope variant or activation that is not implemented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from batchpage.model.config import (
    ModelConfig,
    MoEConfig,
    UnsupportedModelError,
    family_for,
)
from batchpage.model.gemma3_vl_config import with_gemma3_vision
from batchpage.model.gemma_config import gemma_config_from_hf
from batchpage.model.hf_fields import float_field, id_tuple, int_field, require_keys, rope_fields
from batchpage.model.hf_head import read_head
from batchpage.model.idefics3_config import idefics3_text_config, idefics3_vision_config
from batchpage.model.llava_config import llava_text_config, llava_vision_config
from batchpage.model.qwen2_5_vl_config import (
    mrope_section,
    qwen2_5_vl_text_config,
    qwen2_5_vl_vision_config,
)
from batchpage.model.vision_config import VisionConfig
from batchpage.quant.scheme import read_quant_scheme

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# Vision-language families: (their text_config as the language model's config.json, their
# image side given the text model's vocabulary size).
_VISION_READERS: dict[
    str,
    tuple[
        Callable[[Mapping[str, Any]], dict[str, Any]],
        Callable[[Mapping[str, Any], int], VisionConfig],
    ],
] = {
    "llava": (llava_text_config, llava_vision_config),
    "idefics3": (idefics3_text_config, idefics3_vision_config),
    "qwen2_5_vl": (qwen2_5_vl_text_config, qwen2_5_vl_vision_config),
}
_MOE_REQUIRED = {
    "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
    "mixtral": ("num_experts_per_tok", "num_local_experts", "intermediate_size"),
}


def model_config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """Raises UnsupportedModelError for what batchpage does not run, ValueError for a config.json
    that is incomplete or malformed; both name the fix."""
    model_type = cfg.get("model_type")
    family = family_for("hf", model_type)
    quant = read_quant_scheme(cfg)
    if family in ("gemma2", "gemma3", "gemma3_vl"):
        gemma = gemma_config_from_hf(cfg, family)
        if family == "gemma3_vl":  # the text model's config, with its image side
            gemma = with_gemma3_vision(gemma, cfg)
        return dataclasses.replace(gemma, quant=quant, head=read_head(cfg))
    if family in _VISION_READERS:  # the text_config is a Llama's; the image side beside it
        read_text, read_vision = _VISION_READERS[family]
        text = model_config_from_hf(read_text(cfg))
        vision = read_vision(cfg, text.vocab_size)
        # Qwen2.5-VL's language model takes 3-D positions (M-RoPE); the others 1-D ones.
        mrope = mrope_section(cfg) if family == "qwen2_5_vl" else ()
        return dataclasses.replace(text, family=family, vision=vision, mrope_section=mrope)
    require_keys(cfg, _REQUIRED + _MOE_REQUIRED.get(str(model_type), ()))
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only silu is implemented")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not implemented")

    hidden, heads = int_field(cfg, "hidden_size"), int_field(cfg, "num_attention_heads")
    layers = int_field(cfg, "num_hidden_layers")
    head_dim = int_field(cfg, "head_dim") if cfg.get("head_dim") else hidden // heads
    if not cfg.get("head_dim") and hidden % heads:
        raise ValueError(
            f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
            "and there is no head_dim: add the model's head_dim to config.json"
        )
    moe = _moe(str(model_type), cfg, layers)
    if moe is None or not all(moe.sparse_layers):
        require_keys(cfg, ("intermediate_size",))  # a dense MLP runs in some layer
    max_pos = (
        int_field(cfg, "max_position_embeddings") if "max_position_embeddings" in cfg else 2048
    )
    theta, scaling, partial = rope_fields(str(model_type), cfg, max_pos, head_dim)
    qkv_bias, o_bias = _attention_biases(str(model_type), cfg)
    return ModelConfig(
        vocab_size=int_field(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=int_field(cfg, "intermediate_size") if "intermediate_size" in cfg else 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int_field(cfg, "num_key_value_heads")
        if cfg.get("num_key_value_heads")
        else heads,
        head_dim=head_dim,
        family=family,
        rms_norm_eps=float_field(cfg, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial),  # as HF rounds it
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=id_tuple(cfg.get("eos_token_id")),
        layer_windows=_layer_windows(str(model_type), cfg, layers),
        moe=moe,
        model_type=str(model_type),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        quant=quant,
        head=read_head(cfg),
    )


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
            num_experts=int_field(cfg, "num_local_experts"),
            top_k=int_field(cfg, "num_experts_per_tok"),
            intermediate_size=int_field(cfg, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral: softmax over the chosen experts
            sparse_layers=(True,) * layers,
        )
    if model_type != "qwen3_moe":
        return None
    key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    require_keys(cfg, (key,))
    experts, step = int_field(cfg, key), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    if not any(sparse):
        return None
    return MoEConfig(
        num_experts=experts,
        top_k=int_field(cfg, "num_experts_per_tok"),
        intermediate_size=int_field(cfg, "moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
