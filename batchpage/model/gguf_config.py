"""GGUF header -> ModelConfig, refusing what batchpage cannot run before any weight is read.

llama.cpp keeps sizes under `<arch>.*` keys. A few things live in tensors instead: Llama 3.1+
stores its rope scaling as `rope_freqs.weight` (one divisor per frequency), and attention
biases exist exactly when their tensors do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchpage.model.config import ModelConfig, RopeScaling, UnsupportedModelError, family_for
from batchpage.model.gemma_config import GEMMA_FAMILIES, gemma_gguf_config
from batchpage.model.gguf_checks import check_metadata
from batchpage.model.gguf_file import GGUFHeader, read_named_tensor

_SIZE_KEYS = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
ROPE_FREQS = "rope_freqs.weight"


def gguf_config(path: Path, header: GGUFHeader) -> ModelConfig:
    """Raises UnsupportedModelError / ValueError naming the problem and the fix."""
    meta = header.meta
    arch = meta.get("general.architecture")
    family = family_for("gguf", arch)
    check_metadata(path, header)  # every size an integer in range before any is used

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    missing = [f"{arch}.{k}" for k in _SIZE_KEYS if key(k) is None]
    if missing:
        raise ValueError(
            f"{path.name}: GGUF metadata lacks {', '.join(missing)}: the file is incomplete; "
            "convert the model again with llama.cpp's convert_hf_to_gguf.py"
        )
    if key("expert_count"):
        raise UnsupportedModelError(
            f"{path.name}: mixture-of-experts GGUF files are not supported "
            f"({arch}.expert_count={key('expert_count')}): use the model's Hugging Face folder"
        )
    vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens")
    if vocab is None:
        raise ValueError(
            f"{path.name}: GGUF file has neither {arch}.vocab_size nor tokenizer tokens: "
            "convert the model again with its tokenizer"
        )
    names = {t.name for t in header.tensors}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length") or hidden // heads)
    rotary = int(key("rope.dimension_count") or head_dim)
    scaling = _rope_scaling(path, header, key, rotary)
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    cfg = ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=head_dim,
        family=family,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rotary_dim=rotary,
        max_position_embeddings=int(key("context_length", 2048)),
        # llama.cpp drops output.weight when the HF model ties it to the token embedding
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        model_type=str(arch),
        torch_dtype=None,
    )
    return gemma_gguf_config(cfg, key) if family in GEMMA_FAMILIES else cfg


def _rope_scaling(path: Path, header: GGUFHeader, key: Any, rotary: int) -> RopeScaling | None:
    kind = key("rope.scaling.type")
    has_freqs = any(t.name == ROPE_FREQS for t in header.tensors)
    if kind not in (None, "none", "linear") or (kind == "linear" and has_freqs):
        raise UnsupportedModelError(
            f"{path.name}: GGUF rope scaling {kind!r} is not supported (batchpage reads linear "
            "and rope_freqs): use the model's Hugging Face folder"
        )
    if kind == "linear":
        if key("rope.scaling.factor") is None:
            raise ValueError(
                f"{path.name}: linear rope scaling without rope.scaling.factor: convert the "
                "model again"
            )
        return RopeScaling("linear", float(key("rope.scaling.factor")))
    if not has_freqs:
        return None
    factors = read_named_tensor(path, header, ROPE_FREQS).flatten()
    if factors.numel() != rotary // 2:
        raise ValueError(
            f"{path.name}: {ROPE_FREQS} has {factors.numel()} entries, expected {rotary // 2} "
            "(half the rotary dimension): convert the model again"
        )
    return RopeScaling("freq_factors", freq_factors=tuple(factors.tolist()))
