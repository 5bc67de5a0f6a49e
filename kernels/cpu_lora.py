"""Many adapters' LoRA updates in one call: the launcher of cpu_lora.cpp (built once, like the
other CPU kernels, through cpu_build.py), and the plain torch reference of its contract.

For each group (slot, begin, end) of `rows`, each token row r = rows[i] of it and each target t
that slot updates: y[r, starts[t] : starts[t] + size_t] += (x[r] @ a[slot, t*R : (t+1)*R].T)
@ bt[t][slot], summed in float32 and rounded into y once. Why a kernel: the update of one
adapter's rows is a few tiny matmuls per linear, and torch's small matmuls on a CPU cost tens
of microseconds each (bf16 most), so a step of 8 adapters spent more in them than in the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batchpage.kernels.cpu_build import build_extension

SOURCE = Path(__file__).with_name("cpu_lora.cpp")  # shipped in the wheel beside this file


class CpuLoRA:
    """The compiled kernel. Build with `CpuLoRA.build()`."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuLoRA:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(build_extension(SOURCE, "batchpage_cpu_lora", "the LoRA kernel", verbose))

    @property
    def raw(self) -> object:
        """The compiled library: `raw.lora_apply(y, x, a, bt, starts, rows, groups, active)`,
        unchecked, for a caller that checked its layouts once (batchpage/lora/layers.py)."""
        return self._module

    def apply(
        self,
        y: torch.Tensor,  # [T, out], float32 or bfloat16, updated in place
        x: torch.Tensor,  # [T, in], y's dtype
        a: torch.Tensor,  # [S, targets * R, in], y's dtype
        bt: list[torch.Tensor],  # per target [S, R, size_t], y's dtype
        starts: list[int],  # per target: its first column in y
        rows: torch.Tensor,  # int64 [N]: token rows, grouped
        groups: torch.Tensor,  # int64 [G, 3]: (slot, begin, end) into rows
        active: torch.Tensor,  # bool [S, targets]
    ) -> None:
        t, d_in = x.shape
        slots = a.shape[0]
        assert y.device.type == "cpu" and y.dtype in (torch.float32, torch.bfloat16), y.dtype
        assert y.dim() == 2 and y.shape[0] == t and y.is_contiguous(), (y.shape, y.stride())
        assert x.dtype == y.dtype and x.is_contiguous(), (x.dtype, x.stride())
        assert bt and len(bt) == len(starts) and active.shape == (slots, len(bt)), active.shape
        rank = bt[0].shape[1]
        assert a.dtype == y.dtype and a.is_contiguous() and a.shape == (slots, len(bt) * rank, d_in)
        for b, start in zip(bt, starts, strict=True):
            assert b.dtype == y.dtype and b.is_contiguous(), (b.dtype, b.stride())
            assert b.shape[:2] == (slots, rank) and start >= 0 and start + b.shape[2] <= y.shape[1]
        assert rows.dtype == torch.int64 and rows.dim() == 1 and rows.is_contiguous()
        assert groups.dtype == torch.int64 and groups.dim() == 2 and groups.shape[1] == 3
        assert groups.is_contiguous() and active.dtype == torch.bool and active.is_contiguous()
        if len(rows):
            assert int(rows.min()) >= 0 and int(rows.max()) < t, "a row outside x"
        if len(groups):
            assert int(groups[:, 0].min()) >= 0 and int(groups[:, 0].max()) < slots, "a bad slot"
            assert int(groups[:, 1:].min()) >= 0 and int(groups[:, 2].max()) <= len(rows)
        self._module.lora_apply(y, x, a, bt, starts, rows, groups, active)


def reference_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: list[torch.Tensor],
    starts: list[int],
    rows: torch.Tensor,
    groups: torch.Tensor,
    active: torch.Tensor,
) -> torch.Tensor:
    """The contract in float64, row by row: y after the update, as a new float64 tensor."""
    out = y.double().clone()
    rank = bt[0].shape[1]
    for slot, begin, end in groups.tolist():
        for r in rows[begin:end].tolist():
            for t, (b, start) in enumerate(zip(bt, starts, strict=True)):
                if active[slot, t]:
                    h = x[r].double() @ a[slot, t * rank : (t + 1) * rank].double().T
                    out[r, start : start + b.shape[2]] += h @ b[slot].double()
    return out
