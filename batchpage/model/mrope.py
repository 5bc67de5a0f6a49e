"""M-RoPE (Qwen2.5-VL): a prompt's 3-D positions (temporal, height, width), which rope.py turns
into angles section by section of the rotary half-dimensions.

As transformers' get_rope_index: text tokens count on all three axes alike; an image's rows
take its merged grid's (t, h, w) coordinates offset by the position where it starts, and the
text after it resumes at that start + max(h, w). Every position after the prompt (generated
tokens, drafts) is its index p + `delta` on all three axes, `delta` (<= 0) being where the
prompt's positions ended less its length, so a text-only prompt has delta 0 and positions p.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from batchpage.model.image_prompt import PromptImage


class PromptPositions(NamedTuple):
    """A prompt's M-RoPE positions: `positions` int64 [3, prompt length], and `delta`: a
    position p past the prompt is p + delta on each axis."""

    positions: np.ndarray
    delta: int


def merged_grid(image: PromptImage, merge: int) -> tuple[int, int, int]:
    """The image's grid of merger rows (t, h / merge, w / merge), from its processor outputs'
    image_grid_thw (in patches). Raises ValueError when there is none or merge does not divide
    it."""
    grid = image.inputs.get("image_grid_thw")
    if grid is None or grid.numel() != 3:
        raise ValueError(
            "an image's processor outputs have no image_grid_thw of its (t, h, w) patches: use "
            "the model's own image processor"
        )
    t, h, w = (int(n) for n in grid.reshape(3).tolist())
    if h % merge or w % merge:
        raise ValueError(
            f"an image's grid of {h}x{w} patches does not divide into spatial_merge_size="
            f"{merge} squares: use the model's own image processor"
        )
    return t, h // merge, w // merge


def prompt_positions(prompt_len: int, images: Sequence[PromptImage], merge: int) -> PromptPositions:
    """The M-RoPE positions of a prompt of `prompt_len` tokens whose images (each one's rows a
    run of consecutive positions, in its grid's t, h, w raster order) are `images`, and its
    delta, as transformers' get_rope_index computes them for images. Raises ValueError when an
    image's positions are not one run of grid-many rows inside the prompt, or two overlap."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    done = 0  # prompt tokens placed
    at = 0  # the next text position
    for image in sorted(images, key=lambda im: im.positions[0]):
        t, h, w = merged_grid(image, merge)
        first, n = image.positions[0], len(image.positions)
        if (
            n != t * h * w
            or first < done
            or first + n > prompt_len
            or image.positions[-1] != first + n - 1
        ):
            raise ValueError(
                f"an image of {t}x{h}x{w} merged rows has {n} prompt positions from {first} "
                f"(the prompt has {prompt_len}): its rows must be one run of placeholders"
            )
        out[:, done:first] = at + np.arange(first - done)
        at += first - done
        grid = np.indices((t, h, w)).reshape(3, -1)
        out[:, first : first + n] = at + grid
        at += max(h, w)
        done = first + n
    out[:, done:] = at + np.arange(prompt_len - done)
    delta = int(out.max()) + 1 - prompt_len if prompt_len else 0
    return PromptPositions(out, delta)
