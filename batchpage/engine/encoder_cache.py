"""The vision tower's outputs by image content: each image is encoded once while its rows fit the
budget, however many prompts, samples, chunks or recomputations use it.

Keyed by the image's digest (a hash of its decoded pixels), so two prompts with the same picture
share its rows and two pictures never do. Least recently used rows go first when the budget is
full; an image whose rows are gone is encoded again when a step needs it (a recomputed prompt
after a preemption, a later request), unless `encoder_cache_dir` holds them
(engine/encoder_files.py: rows kept across runs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchpage.engine.encoder_files import EncoderFiles
from batchpage.metrics import RunStats
from batchpage.model.causal_lm import ImageEmbeds

if TYPE_CHECKING:
    from batchpage.engine.step_inputs import ImageSlice
    from batchpage.model.image_prompt import PromptImage

Encode = Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]]


class EncoderCache:
    def __init__(
        self,
        encode: Encode,
        max_bytes: int,
        device: torch.device,
        files: EncoderFiles | None = None,
    ) -> None:
        """encode: the model's `encode_images` (each image's processor outputs -> its encoder
        rows [rows, hidden]); max_bytes: the rows kept between steps; files: rows on disk,
        read before encoding and written after."""
        self.encode = encode
        self.max_bytes = max_bytes
        self.device = device
        self.files = files
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def holds(self, digest: bytes) -> bool:
        """Whether the image's rows are kept (a step that uses them runs no tower for it; the
        scheduler's image budget asks)."""
        return digest in self._rows

    def embeds(self, slices: Sequence[ImageSlice], stats: RunStats) -> ImageEmbeds:
        """The step's image inputs: the rows of every slice, in the order of `slices`, encoding
        the images neither held nor on disk (in one call of the tower); counted in
        stats.images_encoded, stats.encoder_cache_hits and stats.encoder_disk_hits."""
        held: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, PromptImage] = {}
        for s in slices:
            digest = s.image.digest
            if digest in held or digest in missing:
                continue
            rows = self._rows.get(digest)
            if rows is None:
                missing[digest] = s.image
            else:
                self._rows.move_to_end(digest)
                held[digest] = rows
                stats.encoder_cache_hits += 1
        if missing and self.files is not None:
            for digest, image in list(missing.items()):
                rows = self.files.read(image.inputs, len(image.positions))
                if rows is not None:
                    held[digest] = rows = rows.to(self.device)
                    self._keep(digest, rows)
                    del missing[digest]
                    stats.encoder_disk_hits += 1
        if missing:
            images = list(missing.values())
            encoded = self.encode([self._inputs(im) for im in images])
            for image, rows in zip(images, encoded, strict=True):
                if rows.shape[0] != len(image.positions):
                    raise ValueError(
                        f"the vision tower gave {rows.shape[0]} rows for an image with "
                        f"{len(image.positions)} placeholder positions: the model's image "
                        "processor and its config disagree"
                    )
                held[image.digest] = rows
                self._keep(image.digest, rows)
                if self.files is not None:
                    self.files.write(image.inputs, rows)
            stats.images_encoded += len(images)
        index = torch.from_numpy(np.concatenate([s.tokens for s in slices]))
        parts = [held[s.image.digest][torch.from_numpy(s.rows)] for s in slices]
        return ImageEmbeds(index.to(self.device), torch.cat(parts))

    def _inputs(self, image: PromptImage) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in image.inputs.items()}

    def _keep(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return  # used by this step only
        while self._bytes + size > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        self._rows[digest] = rows
        self._bytes += size

    def check_integrity(self) -> None:
        """The held rows' bytes are counted exactly and within the budget."""
        total = sum(r.numel() * r.element_size() for r in self._rows.values())
        assert total == self._bytes, f"counted {self._bytes} bytes, hold {total}"
        assert self._bytes <= self.max_bytes, "over the budget"
