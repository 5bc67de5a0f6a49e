"""A prompt's images, placed: each image run through the family's own HF image processor, hashed
by content, and its placeholder token expanded into the positions its encoder rows fill.

The image processor is transformers' (never re-implemented), on its PIL backend: torchvision is
not installed beside batchpage's torch, and the PIL backend is what HF falls back to without it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from batchpage.data.images import image_digest
from batchpage.model.image_rules import REPLACEMENT_RULES, Replacement, ReplacementRule
from batchpage.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from batchpage.model.config import ModelConfig
    from batchpage.model.vision_config import VisionConfig

# Prefix-cache key ids of image positions: bit 62 set, so they never equal a token id, and the
# digest's first 7 bytes (56 bits) below it, so two images collide with chance 2**-56.
IMAGE_KEY_BIT = 1 << 62


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt, ready for the vision tower."""

    digest: bytes  # image_digest of the decoded image
    inputs: dict[str, torch.Tensor]  # the family's HF image processor's outputs for it alone
    positions: tuple[int, ...]  # prompt positions whose embeddings are its encoder rows, in order

    @property
    def key(self) -> int:
        """The prefix cache's key id for those positions: 1 << 62 | the digest's first 7 bytes
        (big-endian)."""
        return IMAGE_KEY_BIT | int.from_bytes(self.digest[:7], "big")


class ImagePrompts:
    """Built once per model (its folder and ModelConfig): the family's HF image processor and the
    family's rule for what replaces one placeholder token."""

    def __init__(self, processor: Any, vision: VisionConfig, rule: ReplacementRule) -> None:
        """processor: a transformers image processor (images=, return_tensors=, and the rule's
        processor_kwargs -> outputs)."""
        self.processor = processor
        self.vision = vision
        self.rule = rule

    @classmethod
    def from_model(
        cls, folder: Path, cfg: ModelConfig, tokenizer: Tokenizer | None = None
    ) -> ImagePrompts:
        """The image side of the checkpoint in `folder`: its preprocessor_config.json through
        transformers' AutoImageProcessor (PIL backend), checked once against the family's rule
        on a blank image. `tokenizer`: the model's, for the families whose expansion is text
        (Idefics3); None: the folder's, loaded only for those. Raises ValueError naming the
        problem: a text model, a family without a rule, a missing or unreadable processor
        config, a processor or tokenizer that does not fit."""
        if cfg.vision is None:
            raise ValueError(
                f"{folder} is a text model ({cfg.model_type}): it takes no images; use a "
                "vision-language checkpoint"
            )
        build = REPLACEMENT_RULES.get(cfg.family)
        if build is None:
            raise ValueError(
                f"images are not implemented for the {cfg.family!r} family: batchpage places "
                f"images for {', '.join(REPLACEMENT_RULES)}"
            )

        def folder_tokenizer() -> Tokenizer:
            if tokenizer is not None:
                return tokenizer
            try:
                return Tokenizer.from_hf_folder(Path(folder))
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"{folder}: the model's tokenizer cannot be loaded ({e}); placing this "
                    "family's images needs it"
                ) from None

        prompts = cls(
            _load_processor(Path(folder)), cfg.vision, build(cfg.vision, folder_tokenizer)
        )
        size = cfg.vision.image_size
        # Mid-grey: a processor that neither rescales nor normalizes keeps it nonzero.
        prompts.rule(prompts._outputs(Image.new("RGB", (size, size), (128, 128, 128))))
        return prompts

    def process(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """The processor's tensors for `image` alone (batch dimension 1). Raises ValueError
        when the processor refuses the image."""
        return _tensors(self._outputs(image))

    def _outputs(self, image: Image.Image) -> Mapping[str, Any]:
        """Everything the processor gives for `image` alone, as the rule reads it."""
        try:
            return self.processor(images=image, return_tensors="pt", **self.rule.processor_kwargs)
        # transformers' processors raise many types on an odd image; each is this image's error.
        except Exception as e:
            raise ValueError(
                f"the model's image processor cannot take this {image.width}x{image.height} "
                f"{image.mode} image: {e}"
            ) from None

    def place(
        self,
        token_ids: list[int],
        images: list[Image.Image],
        uuids: Sequence[str | None] | None = None,
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """Each placeholder token (cfg.vision.image_token_id) in token_ids, in order, replaced by
        the image's tokens (LLaVA: tokens_per_image placeholders; Idefics3: its tiles' text and
        placeholders; Gemma 3: <start_of_image>, its soft tokens and <end_of_image> between
        blank lines, merged with the newlines around them); raises ValueError when the number
        of placeholders is not the number of images, saying both. `images` are decoded
        (load_image's RGB output); an image given twice is processed once. `uuids` (vLLM's
        multi_modal_uuids, one per image or None): the caller's identity of an image, which
        then stands for its content (its digest is the uuid's, the pixels are not hashed):
        equal uuids must mean equal images."""
        placeholder = self.vision.image_token_id
        where = [i for i, t in enumerate(token_ids) if t == placeholder]
        # Counted before anything is expanded, so the result is at most what the images make.
        if len(where) != len(images):
            raise ValueError(
                f"the prompt has {len(where)} image placeholders (token {placeholder}) and "
                f"{len(images)} images were given: put one placeholder where each image goes"
            )
        ids: list[int] = []
        placed: list[PromptImage] = []
        seen: dict[bytes, tuple[dict[str, torch.Tensor], Replacement]] = {}
        start = 0
        uuids = list(uuids) if uuids is not None else [None] * len(images)
        join = self.rule.join  # where the expansion meets the text, as the tokenizer joins them
        for at, image, uuid in zip(where, images, uuids, strict=True):
            join(ids, token_ids[start:at])
            digest = image_digest(image) if uuid is None else uuid_digest(uuid)
            known = seen.get(digest)
            if known is None:
                outputs = self._outputs(image)
                known = seen[digest] = (_tensors(outputs), self.rule(outputs))
            inputs, replacement = known
            join(ids, replacement.ids)  # a join changes only tokens before its rows
            offset = len(ids) - len(replacement.ids)
            placed.append(PromptImage(digest, inputs, tuple(offset + r for r in replacement.rows)))
            start = at + 1
        join(ids, token_ids[start:])
        return ids, tuple(placed)


def uuid_digest(uuid: str) -> bytes:
    """The digest that stands for an image the caller names by `uuid` (never equal to a pixel
    digest: the input is prefixed)."""
    return hashlib.sha256(b"multi_modal_uuid\0" + uuid.encode()).digest()


def _tensors(outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's inputs among a processor's outputs (its tensors; Idefics3's row and column
    counts are lists)."""
    return {k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)}


def _load_processor(folder: Path) -> Any:
    from transformers import AutoImageProcessor

    # transformers 5 picks a backend (torchvision, else PIL with a warning): ask for PIL by name.
    # Before 5, use_fast=False was the PIL processor.
    has_backends = find_spec("transformers.image_processing_backends") is not None
    choice: dict[str, Any] = {"backend": "pil"} if has_backends else {"use_fast": False}
    try:
        return AutoImageProcessor.from_pretrained(folder, local_files_only=True, **choice)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"{folder}: the model's image processor cannot be loaded ({e}); a vision-language "
            "checkpoint needs its preprocessor_config.json"
        ) from None
