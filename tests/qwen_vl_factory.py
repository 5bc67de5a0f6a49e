"""A tiny Qwen2.5-VL built here (random weights, its real image processor, real photographs) for
the tests that check the family, M-RoPE and the API against HF transformers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from tests.extras import require
from tests.model_factory import randomize_weights, save_hf_folder, tiny_tokenizer

require("PIL.Image", "dev")

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# The tiny tower: 6-pixel patches merged 2 x 2 (12 pixels a row), windows of 3 x 3 merged rows
# (36 pixels; an image whose side is not a multiple has smaller windows at its edge), full
# attention in block 1 of 3; the processor keeps an image between 4 and 48 rows.
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=6,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=36,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
)
PROCESSOR = dict(
    patch_size=6,
    temporal_patch_size=2,
    merge_size=2,
    size={"shortest_edge": 12 * 12 * 4, "longest_edge": 12 * 12 * 48},
)
MROPE_SECTION = [2, 3, 3]  # of the text model's 8 rotary half-dimensions (head_dim 16)
# Qwen's chat template's image part, in a ChatML template whose user turns may hold images.
QWEN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer():
    """The tiny tokenizer with Qwen2.5-VL's vision tokens and an image-aware chat template."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = QWEN_CHATML
    return tok


def qwen_processor(**changes):
    """Qwen2-VL's image processor (its PIL variant: no torchvision) sized for the tiny tower."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(**{**PROCESSOR, **changes})


def build_qwen(tok, seed: int = 0, **changes):
    """A float32 HF Qwen2.5-VL for `tok` (2 text layers of 64, M-RoPE sections 2/3/3, the tiny
    tower), every parameter random: norms near 1, the rest as randomize_weights."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    start, end, pad = tok.convert_tokens_to_ids(VISION_TOKENS)
    rope = {"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 10000.0}
    text = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters=rope,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=VISION,
        image_token_id=pad,
        vision_start_token_id=start,
        vision_end_token_id=end,
        attn_implementation="eager",
        **changes,
    )
    torch.manual_seed(seed)
    model = randomize_weights(Qwen2_5_VLForConditionalGeneration(config).float())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def qwen_folder(folder: Path, seed: int = 0):
    """A tiny random Qwen2.5-VL saved with its tokenizer and image processor config. Returns
    (folder, the HF model, the tokenizer)."""
    tok = qwen_tokenizer()
    model = build_qwen(tok, seed)
    save_hf_folder(model, folder, tok)
    qwen_processor().save_pretrained(folder)
    return folder, model, tok


def qwen_inputs(images: list) -> dict:
    """HF's model inputs for one prompt's images, in order."""
    if not images:
        return {}
    outs = [qwen_processor()(images=image, return_tensors="pt") for image in images]
    return {
        "pixel_values": torch.cat([o["pixel_values"] for o in outs]),
        "image_grid_thw": torch.cat([o["image_grid_thw"] for o in outs]),
    }


def hf_prompt_ids(tok, text: str, images: list) -> list[int]:
    """The input_ids HF's Qwen2_5_VLProcessor makes of `text` and `images`: each <|image_pad|>
    replaced by its own replace_image_token (the processor itself cannot be built here: its
    video processor needs torchvision), then tokenized."""
    from transformers import Qwen2_5_VLProcessor

    stand_in = SimpleNamespace(image_processor=qwen_processor(), image_token=VISION_TOKENS[2])
    inputs = qwen_inputs(images)
    pieces = text.split(VISION_TOKENS[2])
    assert len(pieces) == len(images) + 1
    expanded = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        expanded += Qwen2_5_VLProcessor.replace_image_token(stand_in, inputs, i) + piece
    return tok(expanded)["input_ids"]


@torch.no_grad()
def hf_qwen_greedy(model, ids: list[int], images: list, max_new: int) -> list[int]:
    """HF's greedy continuation of a prompt whose <|image_pad|> tokens are expanded already; its
    mm_token_type_ids mark the image rows, as HF's processor returns them (get_rope_index reads
    them)."""
    pad = model.config.image_token_id
    kwargs = qwen_inputs(images)
    if images:
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == pad).int()
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
        **kwargs,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()
