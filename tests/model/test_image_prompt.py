"""ImagePrompts (issue #72) on a tiny LLaVA folder (transformers' LlavaConfig and CLIP image
processor, saved): the processor is transformers' PIL one, loaded silently, and its pixel values
are what transformers' CLIP processor gives for the same photograph; placement expands each
placeholder as a brute-force walk over the prompt does; a placeholder count that is not the image
count, a text model and a processor that does not fit the tower are refused."""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from batchpage.data.images import ImageLimits, image_digest, load_image
from batchpage.model.hf_loader import read_hf_config
from batchpage.model.image_prompt import ImagePrompts, PromptImage
from tests.extras import require

Image = require("PIL.Image", "dev")
skimage_data = require("skimage.data", "dev")

IMAGE_TOKEN = 63
PATCHES = (30 // 6) ** 2  # image_size 30, patch_size 6

# transformers' CLIP processor on its PIL backend: CLIPImageProcessorPil in transformers 5,
# CLIPImageProcessor (PIL-only) before.
CLIPProcessorPil = (
    transformers.CLIPImageProcessorPil
    if hasattr(transformers, "CLIPImageProcessorPil")
    else transformers.CLIPImageProcessor
)


def processor_options(crop: int = 30) -> dict:
    return {"size": {"shortest_edge": 30}, "crop_size": {"height": crop, "width": crop}}


def llava_folder(path: Path, select: str = "default", crop: int = 30) -> Path:
    """config.json and preprocessor_config.json of a tiny LLaVA, as transformers saves them."""
    config = LlavaConfig(
        text_config=LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        ).to_dict(),
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=30,
            patch_size=6,
        ).to_dict(),
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=select,
    )
    config.save_pretrained(path)
    CLIPProcessorPil(**processor_options(crop)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llava_folder(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def prompts(folder: Path) -> ImagePrompts:
    return ImagePrompts.from_model(folder, read_hf_config(folder))


@pytest.fixture(scope="module")
def photos() -> list:
    """Real photographs of different shapes and a generated image, as load_image gives them."""
    arrays = [skimage_data.astronaut(), skimage_data.chelsea(), skimage_data.coffee()]
    rng = np.random.default_rng(0)
    arrays.append(rng.integers(0, 256, (17, 41, 3), dtype=np.uint8))
    return [load_image(Image.fromarray(a), ImageLimits()) for a in arrays]


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_processor_is_transformers_pil_one_loaded_silently(folder: Path, photos: list) -> None:
    # transformers says each of its warnings once per process: forget the ones already said.
    cache_clear = getattr(logging.Logger.__dict__.get("warning_once"), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    said = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(said)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prompts = ImagePrompts.from_model(folder, read_hf_config(folder))
            prompts.place([IMAGE_TOKEN], photos[:1])
    finally:
        logger.removeHandler(said)
    # (Another test's leftovers collected meanwhile are not this test's business.)
    said.messages += [str(w.message) for w in caught if w.category is not ResourceWarning]
    assert not said.messages
    from transformers.image_processing_backends import PilBackend

    assert isinstance(prompts.processor, PilBackend)


def test_pixel_values_are_transformers_clip_processors(prompts: ImagePrompts, photos: list) -> None:
    reference = CLIPProcessorPil(**processor_options())
    ids, placed = prompts.place([1, IMAGE_TOKEN] * len(photos), photos)
    for image, photo in zip(placed, photos, strict=True):
        expected = reference(images=photo, return_tensors="pt")["pixel_values"]
        assert expected.shape == (1, 3, 30, 30)
        assert set(image.inputs) == {"pixel_values"}
        torch.testing.assert_close(image.inputs["pixel_values"], expected, rtol=0, atol=0)


def brute_force(
    token_ids: list[int], n_images: int, per_image: int
) -> tuple[list[int], list[tuple[int, ...]]]:
    """The expansion by walking the prompt one token at a time."""
    out: list[int] = []
    positions: list[tuple[int, ...]] = []
    for t in token_ids:
        if t == IMAGE_TOKEN:
            positions.append(tuple(range(len(out), len(out) + per_image)))
            out += [IMAGE_TOKEN] * per_image
        else:
            out.append(t)
    assert len(positions) == n_images
    return out, positions


def test_placement_matches_brute_force(prompts: ImagePrompts, photos: list) -> None:
    rng = random.Random(0)
    for trial in range(30):
        n = rng.randint(0, 4)
        text = [rng.randrange(0, IMAGE_TOKEN) for _ in range(rng.randint(0, 12))]
        for _ in range(n):  # placeholders anywhere: first, last, adjacent
            text.insert(rng.randint(0, len(text)), IMAGE_TOKEN)
        images = [rng.choice(photos) for _ in range(n)]
        ids, placed = prompts.place(text, images)
        expected_ids, expected_positions = brute_force(text, n, PATCHES)
        assert ids == expected_ids, trial
        assert [p.positions for p in placed] == expected_positions, trial
        for image, given in zip(placed, images, strict=True):
            assert isinstance(image, PromptImage)
            assert image.digest == image_digest(given)
            assert image.key >> 62 == 1
            assert image.key & ((1 << 62) - 1) == int(image.digest[:7].hex(), 16)
            assert all(ids[p] == IMAGE_TOKEN for p in image.positions)


def test_images_are_told_apart_and_the_same_one_is_processed_once(
    prompts: ImagePrompts, photos: list
) -> None:
    calls = []

    def counting(**kwargs):
        calls.append(kwargs["images"])
        return prompts.processor(**kwargs)

    counted = ImagePrompts(counting, prompts.vision, prompts.rule)
    same = load_image(Image.fromarray(np.asarray(photos[0])), ImageLimits())  # equal pixels
    _, placed = counted.place(
        [IMAGE_TOKEN, 5, IMAGE_TOKEN, IMAGE_TOKEN], [photos[0], photos[1], same]
    )
    assert len(calls) == 2
    assert placed[0].key == placed[2].key != placed[1].key
    assert placed[0].digest == placed[2].digest != placed[1].digest
    assert placed[0].positions != placed[2].positions


def test_placeholder_count_must_equal_image_count(prompts: ImagePrompts, photos: list) -> None:
    cases = [([IMAGE_TOKEN, IMAGE_TOKEN], photos[:1]), ([1, 2], photos[:1]), ([IMAGE_TOKEN], [])]
    for token_ids, images in cases:
        placeholders = token_ids.count(IMAGE_TOKEN)
        with pytest.raises(ValueError) as info:
            prompts.place(token_ids, images)
        message = str(info.value)
        assert f"{placeholders} image placeholders (token {IMAGE_TOKEN})" in message
        assert f"{len(images)} images" in message
    # A prompt already expanded (or hostile) is refused before any expansion or processing.
    calls = []
    counted = ImagePrompts(lambda **kw: calls.append(kw), prompts.vision, prompts.rule)
    with pytest.raises(ValueError, match=f"{100_000} image placeholders"):
        counted.place([IMAGE_TOKEN] * 100_000, photos[:1])
    assert calls == []
    assert prompts.place([1, 2, 3], []) == ([1, 2, 3], ())


def test_full_feature_select_takes_the_cls_row_too(tmp_path: Path, photos: list) -> None:
    folder = llava_folder(tmp_path, select="full")
    prompts = ImagePrompts.from_model(folder, read_hf_config(folder))
    ids, placed = prompts.place([7, IMAGE_TOKEN, 8], photos[:1])
    assert ids == brute_force([7, IMAGE_TOKEN, 8], 1, PATCHES + 1)[0]
    assert placed[0].positions == tuple(range(1, PATCHES + 2))


def test_models_and_folders_that_cannot_place_images(tmp_path: Path, folder: Path) -> None:
    llava = read_hf_config(folder)
    text_model = dataclasses.replace(llava, vision=None, family="llama")
    with pytest.raises(ValueError, match="text model"):
        ImagePrompts.from_model(folder, text_model)
    other_family = dataclasses.replace(llava, family="qwen3")
    with pytest.raises(ValueError, match="'qwen3' family"):
        ImagePrompts.from_model(folder, other_family)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        ImagePrompts.from_model(bare, llava)
    # A processor whose crop is not the tower's image size makes another number of rows.
    mismatched = llava_folder(tmp_path / "crop", crop=24)
    with pytest.raises(ValueError, match="crop_size") as info:
        ImagePrompts.from_model(mismatched, read_hf_config(mismatched))
    assert "16 rows" in str(info.value) and f"tokens_per_image={PATCHES}" in str(info.value)
