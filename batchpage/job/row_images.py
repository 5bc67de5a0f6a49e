"""A window's images: each row's image sources decoded with the job's bounds, the window's rows
grouped by image before they go to the engine, and (for the dry run) a prompt's ids and prefix
key with its images placed as the engine places them.

Decoding: dataset.max_image_pixels, max_image_bytes, allow_image_http and image_http_timeout_s
bound every image (batchpage.data.images.load_image); a relative path is read beside the row's
data file (Row.image_folder); a data file in object storage has no folder to read one from, so
such a path is its row's error for now. A row whose image cannot be read fails with that
image's index and the reason. Equal sources (the same bytes, the same path from the same
folder) are decoded once per window and shared by its rows.

Memory: a window's decoded images are held by its prepared rows (job.prompts.Prepared), from
prepare_window until that window has generated: at most dataset.window_rows rows' images at a
time, each up to max_image_pixels x 3 bytes as RGB. A job over large images lowers
dataset.window_rows to bound it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from PIL import Image

from batchpage.data.image_sources import source_key
from batchpage.data.images import ImageError, ImageLimits, load_image, relative_path
from batchpage.data.rows import Row
from batchpage.model.image_prompt import ImagePrompts
from batchpage.storage import is_url

# A word of an image's content key in a prompt's prefix key (dry_run.pack_tokens packs 32-bit
# words): its top bit set, above every token id, as the engine's image keys are.
_KEY_BIT = 1 << 31


class WindowImages:
    """Decodes the images of one window's rows; make one per window, and drop it with it."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        # Each source decoded so far: its image, or what is wrong with it.
        self._seen: dict[tuple[Any, ...], Image.Image | str] = {}

    def load(self, row: Row) -> tuple[Image.Image, ...] | str:
        """The row's images decoded, in order; or the row's error, naming the image's index."""
        images = []
        for i, source in enumerate(row.images or ()):
            key = source_key(source, row.image_folder)
            found = self._seen.get(key)
            if found is None:
                found = self._seen[key] = self._decode(source, row.image_folder)
            if isinstance(found, str):
                return f"image {i}: {found}"
            images.append(found)
        return tuple(images)

    def _decode(self, source: Any, folder: str | None) -> Image.Image | str:
        path = relative_path(source)
        if path is not None and folder is not None and is_url(folder):
            return (
                f"{path!r} is a path relative to a dataset in object storage ({folder}), "
                "where images beside the data are not read yet: give each image as bytes, an "
                "absolute local path, a data: URL or an http(s) URL (with "
                "dataset.allow_image_http=true)"
            )
        limits = self.limits if folder is None else replace(self.limits, base_dir=Path(folder))
        try:
            return load_image(source, limits)
        except ImageError as e:
            return str(e)


class _HasRow(Protocol):
    @property
    def row(self) -> Row: ...


T = TypeVar("T", bound=_HasRow)


def image_order(prepared: Sequence[T]) -> list[T]:
    """The window's rows with those of the same images together, by their sources as given
    (nothing decoded): rows without images first, in their order, then each group of rows with
    equal images, the groups in order of first appearance and each group's rows in theirs: the
    order the engine is handed, so that the questions about one picture are queued back to
    back while its encoder rows and K/V are fresh in the engine's caches (engine.schedule=prefix
    then sorts by token ids, which keeps this order among equal ones)."""
    groups: dict[tuple[Any, ...], list[T]] = {}
    plain: list[T] = []
    for p in prepared:
        row = p.row
        if not row.images:
            plain.append(p)
            continue
        key = tuple(source_key(s, row.image_folder) for s in row.images)
        groups.setdefault(key, []).append(p)
    return plain + [p for group in groups.values() for p in group]


def placed_prompt(
    prompts: ImagePrompts, token_ids: list[int], images: Sequence[Image.Image]
) -> tuple[list[int], list[int]]:
    """A prompt with images as the engine runs it (each placeholder expanded: ImagePrompts.place)
    and as its prefix-cache key, each image position holding a word of its picture's content key
    instead of the placeholder, so that prompts share there only with the same picture (as
    kv_manager.tree_key keys them). ValueError when the placeholders are not the images."""
    ids, placed = prompts.place(token_ids, list(images))
    key = list(ids)
    for image in placed:
        word = _KEY_BIT | (image.key & (_KEY_BIT - 1))
        for at in image.positions:
            key[at] = word
    return ids, key
