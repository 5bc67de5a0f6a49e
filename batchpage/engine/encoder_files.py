"""The vision tower's rows on disk (`encoder_cache_dir`), so a nightly rerun or a resumed job
encodes each image once across runs.

A file holds one image's rows and is named by a hash of what they depend on: the tower's and
projector's weights and dtype (`vision_key`, hashed once at engine setup) and the image's
processor outputs (the pixels as the model sees them, so a changed image processor never reads
another's rows). Files are written whole or not at all (a temporary file renamed), so a job
killed mid-write leaves no half file; a file that does not read back as rows of the expected
shape is ignored and written again.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from batchpage.fileio import atomic_path

log = logging.getLogger(__name__)


def vision_key(vision: nn.Module) -> str:
    """A hash of a vision module's parameters and buffers (names, dtypes, shapes, values): the
    rows it computes depend on nothing else but the image. Call before bind (bound linears may
    hold opaque packed weights)."""
    h = hashlib.sha256()
    for name, t in sorted(vision.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class EncoderFiles:
    def __init__(self, folder: Path, model_key: str) -> None:
        """Rows under folder/<the model's key>/ (one folder per tower, so two models never read
        each other's rows)."""
        self.folder = Path(folder) / model_key[:32]
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, inputs: dict[str, torch.Tensor]) -> Path:
        h = hashlib.sha256()
        for name, t in sorted(inputs.items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return self.folder / f"{h.hexdigest()}.safetensors"

    def read(self, inputs: dict[str, torch.Tensor], rows: int) -> torch.Tensor | None:
        """The rows stored for these processor outputs, or None (none stored, or a file that is
        not `rows` rows: written again)."""
        path = self.path(inputs)
        if not path.is_file():
            return None
        try:
            stored = load_file(path).get("rows")
        except (SafetensorError, OSError) as exc:
            log.warning("ignoring unreadable encoder rows %s: %s", path, exc)
            return None
        if stored is None or stored.dim() != 2 or stored.shape[0] != rows:
            log.warning("ignoring encoder rows %s: not %d rows", path, rows)
            return None
        return stored

    def write(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor) -> None:
        with atomic_path(self.path(inputs)) as tmp:
            save_file({"rows": rows.detach().cpu().contiguous()}, str(tmp))
