"""The images of an API prompt: vLLM's `multi_modal_data` and chat image parts, turned into the
request's prompt images (decoded, bounded, processed by the family's image processor, hashed by
content, their placeholders expanded in the token ids).

A bad image or a placeholder count that does not match the images is that prompt's error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchpage.data.images import ImageLimits, load_image
from batchpage.model.image_prompt import ImagePrompts, PromptImage

# The keys of vLLM's prompt dicts besides the prompt itself.
MULTI_MODAL_KEYS = ("multi_modal_data", "multi_modal_uuids")


def multi_modal_sources(prompt: Mapping[str, Any]) -> list[Any]:
    """The images of a prompt dict's `multi_modal_data` ({"image": one | [several]}), as given
    (PIL images, bytes, paths, URLs); ValueError for another modality or shape."""
    return _images_of(prompt, "multi_modal_data")


def multi_modal_uuids(prompt: Mapping[str, Any], count: int) -> list[str | None] | None:
    """vLLM's `multi_modal_uuids` ({"image": one | [one per image]}, each a str or None): the
    caller's names of the prompt's `count` images; None when it gives none. ValueError when
    they are not one per image or not strings."""
    uuids = _images_of(prompt, "multi_modal_uuids")
    if not uuids:
        return None
    if len(uuids) != count or not all(u is None or isinstance(u, str) for u in uuids):
        raise ValueError(
            f'multi_modal_uuids must give {{"image": [...]}} one str (or None) per image: '
            f"{count} images, got {uuids!r:.80}"
        )
    return uuids


def _images_of(prompt: Mapping[str, Any], key: str) -> list[Any]:
    data = prompt.get(key)
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise ValueError(f'{key} must be {{"image": ...}}, got {type(data).__name__}')
    other = sorted(set(map(str, data)) - {"image"})
    if other:
        raise ValueError(f"{key} holds {other}: batchpage takes images only")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, list | tuple) else [images]


@dataclass(frozen=True)
class PromptImageReader:
    """Places a prompt's images: `prompts` is the model's (None: a text model, which refuses
    images), `limits` bound each image's bytes, pixels and where it may come from."""

    prompts: ImagePrompts | None
    limits: ImageLimits

    def place(
        self, token_ids: list[int], sources: list[Any], uuids: list[str | None] | None = None
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """token_ids with each image's placeholder expanded, and the images (named by `uuids`
        where given: multi_modal_uuids); ValueError (the prompt's error) for a bad image or a
        mismatch."""
        if not sources:
            return token_ids, ()
        if self.prompts is None:
            raise ValueError(
                "this prompt has images and this model takes none: use a vision-language model"
            )
        images = []
        for i, source in enumerate(sources):
            try:
                images.append(load_image(source, self.limits))
            except ValueError as exc:
                raise ValueError(f"image {i}: {exc}") from None
        return self.prompts.place(token_ids, images, uuids)
