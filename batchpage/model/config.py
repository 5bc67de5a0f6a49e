"""ModelConfig: the architecture numbers of a Llama-family decoder, from HF or GGUF metadata.

One frozen dataclass serves Llama, Mistral and Qwen2: they differ only in flags (q/k/v biases,
rope scaling, head_dim, tied embeddings), so the model code in llama.py reads nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but its architecture or a feature of it is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor",
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2; Llama with attention_bias=True)
    o_proj_bias: bool = False  # bias on o_proj (only Llama with attention_bias=True)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral-style sliding-window attention. The engine attends over the full context, which is
    # exact as long as max_model_len <= sliding_window; callers must cap max_model_len to it.
    sliding_window: int | None = None
    model_type: str = "llama"
    torch_dtype: str | None = None  # the checkpoint's own dtype name, used by dtype="auto"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def max_model_len(self) -> int:
        """The longest context this checkpoint supports without leaving its trained regime."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_HF_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} in config.json; batchpage runs "
                f"{', '.join(SUPPORTED_HF_TYPES)} checkpoints"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}: only silu is implemented")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not implemented")

        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _hf_rope(cfg)
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2 hard-codes q/k/v biases and no o_proj bias
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type == "llama" or (model_type == "qwen2" and not cfg.get("use_sliding_window")):
            window = None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_id_tuple(cfg.get("eos_token_id")),
            sliding_window=int(window) if window else None,
            model_type=model_type,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], has_output_weight: bool) -> ModelConfig:
        """From GGUF key/values (scalars and strings; arrays only as their length).

        has_output_weight: whether the file holds `output.weight`; without it the lm_head is the
        token embedding (llama.cpp drops the copy when the HF model ties them).
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; batchpage runs "
                f"{', '.join(SUPPORTED_GGUF_ARCHS)} GGUF files"
            )

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens")
        if vocab is None:
            raise ValueError("GGUF file has neither a vocab_size key nor tokenizer tokens")
        scaling = None
        scaling_type = key("rope.scaling.type")
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"unsupported GGUF rope scaling {scaling_type!r}")
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv") or heads),
            head_dim=int(key("attention.key_length") or hidden // heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            o_proj_bias=False,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            model_type=arch,
            torch_dtype=None,
        )


def _id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _hf_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling) from either `rope_parameters` (transformers 5) or the
    older top-level `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return theta, {
            "rope_type": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
        }
    raise UnsupportedModelError(
        f"unsupported rope scaling {kind!r}: batchpage implements default, linear and llama3"
    )
