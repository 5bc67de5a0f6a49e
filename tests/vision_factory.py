"""Tiny vision-language checkpoints built here (random weights, real image processors, real
photographs) for the tests that check the engine and the API against HF transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.extras import require
from tests.model_factory import randomize_weights, save_hf_folder, tiny_tokenizer

Image = require("PIL.Image", "dev")
skimage_data = require("skimage.data", "dev")

IMAGE_SIZE = 30  # the tiny CLIP tower's input: 5 x 5 patches of 6 pixels
VISION = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=6,
)
# ChatML whose user turns may hold image parts: the template writes <image> for each.
IMAGE_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def clip_processor():
    """CLIP's image processor (its PIL variant: no torchvision) sized for the tiny tower."""
    from transformers import CLIPImageProcessorPil

    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop)


def sample_images() -> list:
    """Real photographs from scikit-image and a generated non-square image."""
    h, w = 47, 71
    ys, xs = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(5).integers(0, 60, (h, w, 3))
    generated = np.stack([xs * 255 // w, ys * 255 // h, (xs + ys) % 256], axis=-1) + noise
    return [
        Image.fromarray(skimage_data.astronaut()),
        Image.fromarray(skimage_data.chelsea()),
        Image.fromarray(skimage_data.coffee()),
        Image.fromarray(np.clip(generated, 0, 255).astype(np.uint8)),
    ]


def text_config(vocab_size: int, bos: int, eos: int) -> dict:
    """The tiny Llama language model of every vision test checkpoint."""
    return dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=bos,
        eos_token_id=eos,
    )


def randomized(make, seed: int):
    """The model `make()` builds, seeded, in float32 with every parameter random: layer norms
    near 1 (their names do not end in `norm.weight`, which randomize_weights sets so), the rest
    as randomize_weights."""
    torch.manual_seed(seed)
    model = randomize_weights(make().to(torch.float32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def build_llava(text: dict, image_token: int, seed: int = 0, **changes):
    """A float32 HF LLaVA (the `text` Llama, the tiny CLIP tower, an MLP projector), every
    parameter random; `changes` go to its config (vision_feature_layer, ...)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        text_config=text,
        vision_config=VISION,
        image_token_index=image_token,
        attn_implementation="eager",
        **changes,
    )
    return randomized(lambda: LlavaForConditionalGeneration(config), seed)


def llava_folder(folder: Path, seed: int = 0):
    """A float32 LLaVA (Llama text model, CLIP tower, MLP projector) with every parameter
    random, saved with a tokenizer that has an <image> token and an image-aware chat template
    and CLIP's processor config. Returns (folder, the HF model, the <image> token id)."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = IMAGE_CHATML
    image_token = tok.convert_tokens_to_ids("<image>")
    text = text_config(len(tok), tok.bos_token_id, tok.eos_token_id)
    model = build_llava(text, image_token, seed)
    save_hf_folder(model, folder, tok)
    clip_processor().save_pretrained(folder)
    return folder, model, image_token


@torch.no_grad()
def hf_llava_greedy(model, ids: list[int], images: list, max_new: int) -> list[int]:
    """HF's greedy continuation of a prompt whose <image> tokens are expanded already (one run
    of placeholders per image, in order)."""
    proc = clip_processor()
    kwargs = {}
    if images:
        pixels = [proc(images=im, return_tensors="pt")["pixel_values"] for im in images]
        kwargs["pixel_values"] = torch.cat(pixels)
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
        **kwargs,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


# Idefics3's / SmolVLM's tiny tower: 32-pixel tiles of 4 x 4 patches of 8, shuffled 2 x 2, so
# each tile is 4 placeholders; the processor resizes an image's longest edge to 96 and splits it
# into tiles of 32 (up to 3 x 3 and the whole image).
IDEFICS3_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)
IDEFICS3_SIZES = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
IDEFICS3_TILE_TOKENS = 4
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]


def idefics3_tokenizer(row_col_tokens: bool = True):
    """The tiny tokenizer with Idefics3's added tokens (and its <row_i_col_j> ones, as released
    checkpoints have them; without, they are text) and an image-aware chat template."""
    tok = tiny_tokenizer()
    extra = IDEFICS3_TOKENS + (ROW_COL_TOKENS if row_col_tokens else [])
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = IMAGE_CHATML
    return tok


def idefics3_processor(model_type: str = "idefics3", **changes):
    """The family's image processor (its PIL variant) sized for the tiny tower."""
    if model_type == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import (
            SmolVLMImageProcessorPil as Processor,
        )
    else:
        from transformers import Idefics3ImageProcessorPil as Processor
    return Processor(**{**IDEFICS3_SIZES, **changes})


def build_idefics3(tok, model_type: str = "idefics3", seed: int = 0, **changes):
    """A float32 HF Idefics3 (or SmolVLM) with a Llama text model for `tok`, every parameter
    random (layer norms near 1, the rest as randomize_weights); `changes` go to its config."""
    import transformers

    prefix = "SmolVLM" if model_type == "smolvlm" else "Idefics3"
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForConditionalGeneration")
    text = text_config(len(tok), tok.bos_token_id, tok.eos_token_id)
    config = config_class(
        text_config=text,
        vision_config=IDEFICS3_VISION,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        attn_implementation="eager",
        **changes,
    )
    return randomized(lambda: model_class(config), seed)


def idefics3_folder(folder: Path, model_type: str = "idefics3", seed: int = 0):
    """A tiny random Idefics3 (or SmolVLM) saved with its tokenizer and image processor config.
    Returns (folder, the HF model, the tokenizer)."""
    tok = idefics3_tokenizer()
    model = build_idefics3(tok, model_type, seed)
    save_hf_folder(model, folder, tok)
    idefics3_processor(model_type).save_pretrained(folder)
    return folder, model, tok


def idefics3_pixels(images: list, model_type: str = "idefics3") -> dict:
    """HF's model inputs for one prompt's images, in order (pixel_values [1, tiles, ...])."""
    out = idefics3_processor(model_type)(images=[images], return_tensors="pt")
    return {k: out[k] for k in ("pixel_values", "pixel_attention_mask")}


@torch.no_grad()
def hf_idefics3_greedy(model, ids: list[int], images: list, max_new: int) -> list[int]:
    """HF's greedy continuation of a prompt whose <image> tokens are expanded already."""
    kwargs = idefics3_pixels(images, model.config.model_type) if images else {}
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
        **kwargs,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()
