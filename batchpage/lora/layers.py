"""LoRALinear: a bound linear plus the low-rank updates of the adapters resident in its slots.

y = base(x), then for each adapter slot s the step's rows of s run: y[rows] += (x[rows] @ A_s.T)
@ B_s.T, per target (a fused linear's parts: q/k/v of qkv_proj, gate/up of gate_up_proj, each
its own A and B, placed in its slice of the output). The base linear runs once for all rows,
whatever its implementation (dense, packed, quantized); the updates are grouped by adapter,
one pair of matmuls per adapter present in the step, not per row (vLLM's punica kernels batch
the same way by segment).

The slots are preallocated: A [slots, max_rank, in] and B [slots, out_part, max_rank] per
target, zero past an adapter's own rank, so any resident adapter computes with the same shapes.
`AdapterStep` says which of the step's token rows run which slot; one object, set once a step
by the model runner, read by every LoRALinear of the model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchpage.ops.linear import LinearOp


class AdapterGroup(NamedTuple):
    slot: int
    rows: torch.Tensor | None  # int64 token rows of the step; None: every row


class AdapterStep:
    """The step's token rows per adapter slot (rows of the base model run no update)."""

    def __init__(self) -> None:
        self.groups: list[AdapterGroup] = []

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots: int64 [T], each token row's slot, -1 for the base model; None: no row
        runs an adapter."""
        if token_slots is None:
            self.groups = []
            return
        present = [s for s in torch.unique(token_slots).tolist() if s >= 0]
        if len(present) == 1 and bool((token_slots == present[0]).all()):
            self.groups = [AdapterGroup(present[0], None)]
            return
        self.groups = [AdapterGroup(s, torch.nonzero(token_slots == s).squeeze(1)) for s in present]


class LoRALinear(LinearOp):
    """`base` with room for `slots` adapters of rank at most `max_rank` on each target, a
    target being a slice [start, start + size) of base's output (the whole of it for an
    unfused linear)."""

    def __init__(
        self,
        base: LinearOp,
        targets: list[tuple[int, int]],  # (start, size) in base's output, one per target
        slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: AdapterStep,
    ) -> None:
        super().__init__()
        assert sum(size for _, size in targets) <= base.out_features
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.targets = targets
        self.max_rank = max_rank
        self.step = step
        # A of every target stacked, so the down-projection is one matmul a group.
        rows = len(targets) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(slots, rows, self.in_features, dtype=dtype, device=device)
        )
        for t, (_, size) in enumerate(targets):
            self.register_buffer(
                f"lora_b{t}", torch.zeros(slots, size, max_rank, dtype=dtype, device=device)
            )
        self.active = [[False] * len(targets) for _ in range(slots)]  # targets each slot updates

    def load(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A [r, in], B [size, r], B scaled) of each target, None for a
        target it leaves alone, into `slot`, replacing whatever was there."""
        assert len(pieces) == len(self.targets)
        r = self.max_rank
        self.lora_a[slot].zero_()
        for t, piece in enumerate(pieces):
            b = getattr(self, f"lora_b{t}")[slot]
            b.zero_()
            self.active[slot][t] = piece is not None
            if piece is None:
                continue
            a_t, b_t = piece
            rank = a_t.shape[0]
            assert a_t.shape == (rank, self.in_features) and rank <= r
            assert b_t.shape == (self.targets[t][1], rank)
            self.lora_a[slot, t * r : t * r + rank].copy_(a_t)
            b[:, :rank].copy_(b_t)

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(x, out)
        r = self.max_rank
        for slot, rows in self.step.groups:
            active = self.active[slot]
            if not any(active):
                continue
            xs = x if rows is None else x.index_select(0, rows)
            h = xs @ self.lora_a[slot].t()  # [n, targets * r]
            delta = (
                y
                if rows is None
                else torch.zeros(xs.shape[0], self.out_features, dtype=y.dtype, device=y.device)
            )
            for t, (start, size) in enumerate(self.targets):
                if active[t]:
                    b = getattr(self, f"lora_b{t}")[slot]
                    delta[:, start : start + size].addmm_(h[:, t * r : (t + 1) * r], b.t())
            if rows is not None:
                y.index_add_(0, rows, delta)
        return y

    @property
    def weight_format(self) -> str:
        return self.base.weight_format

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.weight_rows(ids)
