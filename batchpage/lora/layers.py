"""LoRALinear: a bound linear plus the low-rank updates of the adapters resident in its slots.

y = base(x), then for each adapter slot s the step's rows of s run: y[rows] += (x[rows] @ A_s.T)
@ B_s.T, per target (a fused linear's parts: q/k/v of qkv_proj, gate/up of gate_up_proj, each
its own A and B, placed in its slice of the output). The base linear runs once for all rows,
whatever its implementation (dense, packed, quantized); the updates are grouped by adapter,
never computed per row (vLLM's punica kernels batch the same way, by segment).

The slots are preallocated: A [slots, targets * max_rank, in] and, per target, B transposed
[slots, max_rank, size], zero past an adapter's own rank, so any resident adapter computes with
the same shapes. `AdapterStep` says which of the step's token rows run which slot; one object,
set once a step by the model runner, read by every LoRALinear of the model. How the updates
are computed is chosen once, when the model is wrapped: the C++ kernel (kernels/cpu_lora.cpp)
on a CPU where it builds, the Triton kernels (kernels/lora_update.py) on a GPU, else torch's
matmuls (`TorchUpdate`); all three compute the same contract.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from batchpage.ops.linear import LinearOp


class AdapterGroup(NamedTuple):
    slot: int
    # The step's token rows it covers: a run [start, stop) (views of x and y, no copies), or
    # int64 row indices (gathered and scattered back).
    rows: slice | torch.Tensor


class AdapterStep:
    """The step's token rows per adapter slot (rows of the base model run no update): as
    `groups`, and as the kernel's `rows` (int64 [N], grouped) and `index` (int64 [G, 3]: slot,
    begin, end into rows)."""

    def __init__(self) -> None:
        self.groups: list[AdapterGroup] = []
        self.rows = torch.zeros(0, dtype=torch.int64)
        self.index = torch.zeros(0, 3, dtype=torch.int64)

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots: int64 [T], each token row's slot, -1 for the base model; None: no row
        runs an adapter. The scheduler queues an adapter's rows together, so a step's rows
        mostly come in runs of one adapter: each run is a group. When the rows are scattered
        (more runs than twice the adapters), each adapter's rows are one gathered group."""
        if token_slots is None:
            self.groups = []
            return
        slots = token_slots.cpu()
        change = torch.nonzero(slots[1:] != slots[:-1]).squeeze(1) + 1
        starts = [0, *change.tolist()]
        stops = [*starts[1:], len(slots)]
        firsts = slots[starts].tolist()
        runs = [(s, a, b) for s, a, b in zip(firsts, starts, stops, strict=True) if s >= 0]
        present = sorted({s for s, _, _ in runs})
        if len(runs) <= 2 * len(present):
            self.groups = [AdapterGroup(s, slice(a, b)) for s, a, b in runs]
            parts = [torch.arange(a, b) for _, a, b in runs]
        else:
            parts = [torch.nonzero(slots == s).squeeze(1) for s in present]
            self.groups = [AdapterGroup(s, r) for s, r in zip(present, parts, strict=True)]
        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        ends = sizes.cumsum(0)
        slot_of = torch.tensor([g.slot for g in self.groups], dtype=torch.int64)
        self.index = torch.stack([slot_of, ends - sizes, ends], 1).contiguous()
        rows = torch.cat(parts) if parts else self.rows[:0]
        self.rows = rows.to(token_slots.device)  # the index stays on the host


class LoRAUpdate(Protocol):
    """Adds the step's adapter updates to y = layer.base(x), in place."""

    def __call__(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> None: ...


class TorchUpdate:
    """torch's matmuls, a few per group: any device."""

    def __call__(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> None:
        r = layer.max_rank
        active = layer.active_list
        for slot, rows in layer.step.groups:
            if not any(active[slot]):
                continue
            run = isinstance(rows, slice)
            xs = x[rows] if run else x.index_select(0, rows)
            h = xs @ layer.lora_a[slot].t()  # [n, targets * r]
            delta = y[rows] if run else torch.zeros_like(y[: xs.shape[0]])
            for t, (start, size) in enumerate(layer.targets):
                if active[slot][t]:
                    bt = layer.lora_bt[t][slot]  # [r, size]
                    delta[:, start : start + size].addmm_(h[:, t * r : (t + 1) * r], bt)
            if not run:
                y.index_add_(0, rows, delta)


class KernelUpdate:
    """The C++ kernel (kernels/cpu_lora.cpp): one call a linear a step, whatever the groups.
    Its layouts are checked once, when a layer is wrapped (`check`)."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel  # CpuLoRA

    def check(self, layer: LoRALinear) -> None:
        x = torch.zeros(1, layer.in_features, dtype=layer.lora_a.dtype)
        y = torch.zeros(1, layer.out_features, dtype=layer.lora_a.dtype)
        rows, index = torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.int64)
        args = (layer.lora_a, layer.lora_bt, layer.starts, rows, index, layer.active)
        self.kernel.apply(y, x, *args)  # type: ignore[attr-defined]

    def __call__(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> None:
        step = layer.step
        assert y.is_contiguous()
        self.kernel.raw.lora_apply(  # type: ignore[attr-defined]
            y, x.contiguous(), layer.lora_a, layer.lora_bt, layer.starts, step.rows, step.index,
            layer.active,
        )  # fmt: skip


class TritonUpdate:
    """The Triton kernels (kernels/lora_update.py): two launches per target a linear a step;
    the step's row tiles made once, for its first linear."""

    def __init__(self) -> None:
        from batchpage.kernels.lora_update import lora_apply, row_tiles

        self.lora_apply, self.row_tiles = lora_apply, row_tiles
        self._index: torch.Tensor | None = None  # the step whose tiles these are
        self._tiles = torch.zeros(0, 3, dtype=torch.int64)

    def __call__(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> None:
        step = layer.step
        if self._index is not step.index:  # a new step (set makes a new index)
            self._index, self._tiles = step.index, self.row_tiles(step.index).to(y.device)
        self.lora_apply(
            y, x, layer.lora_a, layer.lora_bt, layer.starts, step.rows, step.index, layer.active,
            self._tiles,
        )  # fmt: skip


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
        update: LoRAUpdate,
    ) -> None:
        super().__init__()
        assert sum(size for _, size in targets) <= base.out_features
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.targets = targets
        self.starts = [start for start, _ in targets]
        self.max_rank = max_rank
        self.step = step
        self.update = update
        # A of every target stacked, so the down-projection is one matmul a group.
        rows = len(targets) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(slots, rows, self.in_features, dtype=dtype, device=device)
        )
        self.lora_bt = [
            torch.zeros(slots, max_rank, size, dtype=dtype, device=device) for _, size in targets
        ]
        for t, b in enumerate(self.lora_bt):
            self.register_buffer(f"lora_bt{t}", b)
        # Which targets each slot updates: the kernel's tensor, and a list to read in Python.
        self.active = torch.zeros(slots, len(targets), dtype=torch.bool, device=device)
        self.active_list = [[False] * len(targets) for _ in range(slots)]
        if isinstance(update, KernelUpdate):
            update.check(self)

    def load(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put an adapter's (A [r, in], B [size, r], B scaled) of each target, None for a
        target it leaves alone, into `slot`, replacing whatever was there."""
        assert len(pieces) == len(self.targets)
        r = self.max_rank
        self.lora_a[slot].zero_()
        for t, piece in enumerate(pieces):
            bt = self.lora_bt[t][slot]
            bt.zero_()
            self.active[slot, t] = piece is not None
            self.active_list[slot][t] = piece is not None
            if piece is None:
                continue
            a_t, b_t = piece
            rank = a_t.shape[0]
            assert a_t.shape == (rank, self.in_features) and rank <= r
            assert b_t.shape == (self.targets[t][1], rank)
            self.lora_a[slot, t * r : t * r + rank].copy_(a_t)
            bt[:rank].copy_(b_t.t())

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(x, out)
        if self.step.groups:
            self.update(self, x, y)
        return y

    @property
    def weight_format(self) -> str:
        return self.base.weight_format

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.weight_rows(ids)
