"""Image spans computed whole: for a family whose image rows attend to each other both ways
(Gemma 3: VisionLanguageBase.BIDIRECTIONAL_IMAGES), a prompt chunk never ends inside an image's
span, and the rows of a span see all of it (AttentionMetadata.key_end).

An image's span is its positions, first to last (PromptImage.positions, consecutive for these
families). Ending a chunk inside one would compute its first rows before the rest of the span
exists; their K/V, and everything that reads it, would differ from the model's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from batchpage.engine.sequence import Sequence


def whole_spans(seq: Sequence, start: int, take: int) -> int:
    """Of seq's next `take` tokens from position `start`, those a step computes so that the chunk
    ends outside every image span. A chunk that would end inside a span is cut back to the
    span's start when it starts before it (the span goes whole into a later chunk); when it
    starts at the span's start or inside it (a prefix-cache hit that ends inside a span: the
    cached K/V was computed with the whole span visible), it runs to the span's end even past
    the step's budget, since cutting it back would leave nothing to compute: the step then
    exceeds its token budget by less than one span, as a step's first image is encoded however
    large (image_budget.py)."""
    end = start + take
    if not take:
        return 0
    for image in seq.request.images:
        first, stop = image.positions[0], image.positions[-1] + 1
        if first < end < stop:
            return first - start if start < first else stop - start
    return take


def span_key_ends(
    slices: Iterable[tuple[np.ndarray, int]],  # (step rows of a span's positions, its end)
    positions: np.ndarray,  # int64 [T]: each step row's position
    row_ends: np.ndarray,  # int64 [T]: each step row's sequence's context length after the step
    query_start: np.ndarray,  # int64 [B + 1]
) -> tuple[np.ndarray | None, tuple[int, ...]]:
    """The step's key_end from its image slices (step_inputs.ImageSlice: their token rows and
    their image's span end): int32 [T], a row of an image span sees up to the span's end, every
    other row up to itself; and the sequences with a row that sees past itself; (None, ()) when
    no row does. Raises RuntimeError when a span does not end inside its row's context (the
    scheduler ended a chunk inside it)."""
    key_end = positions + 1
    for rows, end in slices:
        key_end[rows] = end
    wide = np.flatnonzero(key_end > positions + 1)
    if not len(wide):
        return None, ()
    if (key_end[wide] > row_ends[wide]).any():
        raise RuntimeError(
            "a prompt chunk ends inside an image span whose rows attend both ways: the "
            "scheduler must keep such spans whole (engine/image_spans.py); this is a bug"
        )
    seqs = np.unique(np.searchsorted(query_start, wide, side="right") - 1)
    return key_end.astype(np.int32), tuple(seqs.tolist())
