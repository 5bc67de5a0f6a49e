"""The activation buffers of one forward pass."""

from __future__ import annotations

import torch


class Workspace:
    """[rows, width] buffers by role (the normed stream, q/k/v, the attention projection, the
    MLP's activation and output), each allocated at its first `take` and handed to every later
    layer that takes the same role and width: a forward allocates each buffer once, not once a
    layer.

    Contract: a buffer's contents belong to whoever took it last; a layer must be done reading
    a role's buffer before it (or the next layer) takes that role again. Valid for one forward:
    the rows are that step's tokens."""

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows, self.dtype, self.device = rows, dtype, device
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def take(self, role: str, width: int) -> torch.Tensor:  # [rows, width], contiguous
        key = (role, width)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(self.rows, width, dtype=self.dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer
