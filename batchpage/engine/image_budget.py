"""How much of the vision tower's work a step may start: the scheduler cuts a prompt chunk before
an image the tower would have to encode past the step's budget (the step's token budget, in
encoder rows), as it cuts chunks at the token budget. A step's first image is always encoded,
however large, so every prompt makes progress; images the encoder cache holds cost nothing, and
an image two prompts share in one step is encoded once.
"""

from __future__ import annotations

from collections.abc import Callable

from batchpage.engine.sequence import Sequence


def holds_nothing(digest: bytes) -> bool:
    """The encoder cache of a model without images (and of the simulator)."""
    return False


class ImageBudget:
    def __init__(self, limit: int, holds: Callable[[bytes], bool] = holds_nothing) -> None:
        """`limit`: encoder rows a step may start; `holds(digest)`: whether the encoder cache
        has the image's rows (engine/encoder_cache.py), so it costs nothing."""
        self.limit = limit
        self.holds = holds
        self.spent = 0
        self.encoded: set[bytes] = set()

    def new_step(self) -> None:
        self.spent = 0
        self.encoded = set()

    def cut(self, seq: Sequence, start: int, take: int) -> int:
        """Of seq's next `take` tokens from position `start`, those this step may compute: up to
        the first position of the first image in them that is neither held nor encoded this
        step already and does not fit what the step has left (the images before it are
        charged)."""
        end = start + take
        for image in seq.request.images:
            first, last = image.positions[0], image.positions[-1]
            if last < start or first >= end:
                continue
            digest = image.digest
            if digest in self.encoded or self.holds(digest):
                continue
            rows = len(image.positions)
            if self.spent and self.spent + rows > self.limit:
                return max(first - start, 0)
            self.spent += rows
            self.encoded.add(digest)
        return take
