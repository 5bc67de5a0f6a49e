"""A row's images as the data gives them, before any is decoded: the image column's cell (one
image or a list), the dataset's image options (checked before the model loads), and each
source's cheap key (equal paths, URLs or bytes are one image) for grouping rows by image.

An image source is what batchpage.data.images.load_image reads: encoded bytes, a HF datasets /
Parquet image cell {"bytes", "path"}, a path (relative ones are read beside the row's data
file), a file:, data: or http(s) URL. Decoding is the job's (batchpage.job.row_images), one
window at a time.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Protocol

from batchpage.data.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, ImageLimits
from batchpage.data.input_files import DatasetError


class ImageOptions(Protocol):
    """The dataset's image options (DatasetSpec has them; named here by shape, since the spec
    reads rows through this module)."""

    image_column: str | None
    max_image_pixels: int | float
    max_image_bytes: int | float
    allow_image_http: bool
    image_http_timeout_s: int | float


# How the job's user names ImageLimits' settings (ImageLimits.option).
OPTION_PREFIX = "dataset."
_IMAGE_TYPES = (bytes, bytearray, memoryview, str, dict)


def check_image_options(spec: ImageOptions) -> None:
    """DatasetError (one line, before the model loads) for an image bound that is not a
    positive number."""
    for name in ("max_image_pixels", "max_image_bytes", "image_http_timeout_s"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise DatasetError(f"{OPTION_PREFIX}{name}={value} must be a number > 0")
        if not math.isfinite(value):
            raise DatasetError(f"{OPTION_PREFIX}{name}={value} must be finite")


def image_fingerprint(spec: ImageOptions) -> dict[str, Any]:
    """The fingerprint's image settings: what decides which rows' images are read (and so which
    rows fail); only those set otherwise than their defaults, so other jobs keep their key."""
    key: dict[str, Any] = {}
    if spec.image_column is not None:
        key["image_column"] = spec.image_column
    for name, default in (
        ("max_image_pixels", DEFAULT_MAX_PIXELS),
        ("max_image_bytes", DEFAULT_MAX_BYTES),
        ("allow_image_http", False),
    ):
        if getattr(spec, name) != default:
            key[name] = getattr(spec, name)
    return key


def image_limits(spec: ImageOptions, base_dir: Path | None = None) -> ImageLimits:
    """What the job reads of each image (the dataset.*image* options); relative paths from
    base_dir."""
    return ImageLimits(
        max_pixels=int(spec.max_image_pixels),
        max_bytes=int(spec.max_image_bytes),
        allow_http=spec.allow_image_http,
        http_timeout_s=float(spec.image_http_timeout_s),
        base_dir=base_dir,
        option_prefix=OPTION_PREFIX,
    )


def column_images(value: Any) -> tuple[list[Any], str | None]:
    """The image sources of an image column's cell, in order, and the cell's error (None when
    it is fine). A null cell, blank text or an empty list is a row without images."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return [], None
    items = list(value) if isinstance(value, list | tuple) else [value]
    for i, item in enumerate(items):
        where = f"image column item {i}" if isinstance(value, list | tuple) else "image column"
        if item is None:
            return [], f"the {where} is null: drop it from the list, or give an image"
        if not isinstance(item, _IMAGE_TYPES):
            return [], (
                f"the {where} holds a {type(item).__name__}; give encoded image bytes, a "
                "{bytes, path} image struct, a path or a URL (one, or a list per row)"
            )
    return items, None


def source_key(source: Any, folder: str | None) -> tuple[Any, ...]:
    """A key equal for equal sources as given (the same bytes, the same path or URL read from
    the same folder), without decoding: bytes by a hash, text as it is."""
    if isinstance(source, dict):
        source = source.get("path") if source.get("bytes") is None else source["bytes"]
    if isinstance(source, bytes | bytearray | memoryview):
        return ("bytes", hashlib.blake2b(source, digest_size=16).digest())
    if isinstance(source, str):
        return ("text", folder or "", source)
    return ("object", id(source))  # not from a dataset: nothing to compare but identity
