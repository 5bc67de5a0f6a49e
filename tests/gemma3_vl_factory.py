"""A tiny random Gemma 3 with images built here (transformers' own config and model classes, a
real Gemma3ImageProcessor config, a Gemma-style tokenizer), for the tests that check the engine
and the API against HF transformers.

The tokenizer is a GemmaTokenizer (BPE, byte fallback, "▁" for spaces, BOS added) over single
characters, with Gemma's image tokens and its runs of newlines as tokens of their own (merged
from "\\n"), so HF's Gemma3Processor meets the newline merges of a real Gemma tokenizer.

The tower makes 8 x 8 patches, pooled 2 x 2 to 16 rows an image: a span longer than the text
model's sliding window (8), so the window and the span bound each other.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers.processors import TemplateProcessing

from tests.extras import require
from tests.gemma_factory import GEMMA_VARIANTS
from tests.model_factory import save_hf_folder

transformers = require("transformers", "dev")

IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 16
VISION = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=4,
    layer_norm_eps=1e-6,
)
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma 3's chat template, reduced to what the tests use: BOS, turns, image and text parts.
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_tokenizer():
    """The Gemma-style tokenizer described in the module docstring."""
    vocab = {t: i for i, t in enumerate(SPECIAL + TURNS + IMAGE_TOKENS[:2])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(ch, len(vocab))
    for k in range(1, 5):
        vocab["\n" * k] = len(vocab)
    vocab[IMAGE_TOKENS[2]] = len(vocab)
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    tok = transformers.GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens={
            "boi_token": IMAGE_TOKENS[0],
            "eoi_token": IMAGE_TOKENS[1],
            "image_token": IMAGE_TOKENS[2],
        },
        chat_template=GEMMA_CHAT,
    )
    tok.add_special_tokens({"additional_special_tokens": TURNS + IMAGE_TOKENS})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return tok


def gemma3_processor():
    """Gemma 3's image processor (its PIL variant: no torchvision) sized for the tiny tower."""
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def hf_processor(tok):
    """HF's whole Gemma3Processor (the prompt's expansion and token ids) for the tokenizer."""
    return transformers.Gemma3Processor(
        gemma3_processor(), tok, chat_template=GEMMA_CHAT, image_seq_length=TOKENS_PER_IMAGE
    )


def _randomize(model, seed: int):
    """Every parameter random: Gemma's RMSNorm weights (which scale by 1 + w) near 0, SigLIP's
    LayerNorm weights near 1, biases small, the rest N(0, 0.08)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            layer_norm = "vision_tower" in name and "norm" in name and name.endswith("weight")
            if layer_norm:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def build_gemma3_vl(tok, seed: int = 0, **changes):
    """A float32 HF Gemma3ForConditionalGeneration over `tok` (Gemma 3's tiny text model of
    tests/gemma_factory.py, windows of 8), every parameter random; `changes` go to its config."""
    _, text = GEMMA_VARIANTS["gemma3"]
    config = transformers.Gemma3Config(
        text_config=dict(text, vocab_size=len(tok)),
        vision_config=VISION,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=tok.convert_tokens_to_ids(IMAGE_TOKENS[0]),
        eoi_token_index=tok.convert_tokens_to_ids(IMAGE_TOKENS[1]),
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKENS[2]),
        bos_token_id=tok.convert_tokens_to_ids("<bos>"),
        eos_token_id=tok.convert_tokens_to_ids("<eos>"),
        pad_token_id=0,
        attn_implementation="eager",
        **changes,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    return _randomize(model, seed)


def gemma3_vl_folder(folder: Path, seed: int = 0):
    """The tiny random Gemma 3 saved with its tokenizer and image processor config. Returns
    (folder, the HF model, the tokenizer)."""
    tok = gemma_tokenizer()
    model = build_gemma3_vl(tok, seed)
    save_hf_folder(model, folder, tok)
    gemma3_processor().save_pretrained(folder)
    return folder, model, tok


@torch.no_grad()
def hf_gemma3_greedy(model, inputs: dict, max_new: int) -> list[int]:
    """HF's greedy continuation of a Gemma3Processor output (input_ids, token_type_ids and
    pixel_values when it has images)."""
    ids = inputs["input_ids"]
    kwargs = {k: v for k, v in inputs.items() if k in ("pixel_values", "token_type_ids")}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
        min_new_tokens=max_new, **kwargs,
    )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()
