"""Tiny random Gemma 2 and Gemma 3 checkpoints built with transformers' own config classes, and a
llama.cpp-style GGUF writer for them (Gemma's tensor names and keys, its norms stored as 1 + w).

Every parameter is random, norms included (drawn around 0, since Gemma scales by 1 + weight).
Windows of 8 tokens and soft-caps small enough to bend the scores make each feature visible in
short test sequences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    PreTrainedModel,
)

WINDOW = 8
_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=WINDOW,
)
GEMMA_VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    # query_pre_attn_scalar != head_dim, both soft-caps, untied: every Gemma 2 feature
    "gemma2": (
        Gemma2Config,
        dict(
            _BASE,
            num_hidden_layers=4,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            tie_word_embeddings=False,
        ),
    ),
    # as llama.cpp reads a Gemma 2 GGUF: scale head_dim ** -0.5, tied, caps as stated
    "gemma2_gguf": (
        Gemma2Config,
        dict(
            _BASE,
            num_hidden_layers=2,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
        ),
    ),
    # five local layers per global one, linear scaling on the global rope, a final soft-cap;
    # the default pattern and local rope base, so its GGUF reads back the same
    "gemma3": (
        Gemma3TextConfig,
        dict(
            _BASE,
            num_hidden_layers=6,
            query_pre_attn_scalar=16,
            final_logit_softcapping=2.0,
            rope_scaling=dict(rope_type="linear", factor=4.0),
        ),
    ),
    # its own layer pattern and rope bases, MQA, attention biases
    "gemma3_pattern": (
        Gemma3TextConfig,
        dict(
            _BASE,
            num_hidden_layers=4,
            num_key_value_heads=1,
            query_pre_attn_scalar=20,
            sliding_window_pattern=2,
            attention_bias=True,
            rope_theta=5000.0,
            rope_local_base_freq=100.0,
            tie_word_embeddings=False,
        ),
    ),
}


def _randomize(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def build_gemma(variant: str, vocab_size: int = 320, seed: int = 0) -> PreTrainedModel:
    """A float32 transformers Gemma of the named variant with all parameters random."""
    config_cls, kwargs = GEMMA_VARIANTS[variant]
    config = config_cls(
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
        **kwargs,
    )
    return _randomize(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)


def build_gemma3_multimodal(vocab_size: int = 320, seed: int = 0) -> PreTrainedModel:
    """A Gemma3ForConditionalGeneration with a one-layer image tower: its text model is what a
    text-only engine runs."""
    _, text = GEMMA_VARIANTS["gemma3"]
    config = Gemma3Config(
        text_config=dict(text, vocab_size=vocab_size),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        image_token_index=vocab_size - 1,
        boi_token_index=vocab_size - 2,
        eoi_token_index=vocab_size - 3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return _randomize(Gemma3ForConditionalGeneration(config).to(torch.float32), seed)


_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


@torch.no_grad()
def write_gemma_gguf(
    hf: PreTrainedModel, path: Path, matrix_type: str = "F16", embed_type: str = "Q8_0"
) -> Path:
    """Write `hf` as llama.cpp's converter does (convert_hf_to_gguf.py, Gemma2Model and
    Gemma3Model): norms as 1 + weight in F32, matrices matrix_type, token embedding embed_type,
    soft-caps and window as keys. `hf`'s weights are rounded in place to what the file stores."""
    cfg = hf.config
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        rope = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, p in hf.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        qtype = gguf.GGMLQuantizationType[
            "F32" if p.ndim == 1 else embed_type if "embed_tokens" in name else matrix_type
        ]
        shift = 1.0 if name.endswith("norm.weight") else 0.0
        stored = gguf.quants.quantize((p + shift).float().numpy(), qtype)
        back = torch.from_numpy(gguf.quants.dequantize(stored, qtype).reshape(p.shape))
        p.copy_(back - shift)
        w.add_tensor(_gguf_name(name), stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
