"""LoRALinear against each row computed on its own in plain torch (float64, on the CPU). The
Triton update runs on CUDA where there is one (else in Triton's interpreter on the CPU); the
others on the CPU."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.cpu_lora import CpuLoRA
from batchpage.lora.layers import (
    AdapterStep,
    KernelUpdate,
    LoRALinear,
    TorchUpdate,
    TritonUpdate,
)
from batchpage.ops.linear import dense_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_update(name: str):
    """Each implementation of the update (the C++ kernel's and torch's on the CPU)."""
    if name == "kernel":
        return KernelUpdate(CpuLoRA.build())
    return TritonUpdate() if name == "triton" else TorchUpdate()


def device_of(update: str) -> torch.device:
    """Where `update`'s layer lives: the Triton kernels' device, else the CPU."""
    return torch.device(DEVICE if update == "triton" else "cpu")


@pytest.mark.parametrize("update", ["torch", "kernel", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["scattered", "runs", "one adapter", "base only"])
def test_each_row_gets_its_own_adapters_update(update, dtype, layout):
    gen = torch.Generator().manual_seed(0)
    d_in, sizes, slots, max_rank = 24, [16, 8, 8], 3, 6
    weight = torch.randn(sum(sizes), d_in, generator=gen).to(dtype)
    bias = torch.randn(sum(sizes), generator=gen).to(dtype)
    step = AdapterStep()
    starts = [0, 16, 24]
    dev = device_of(update)
    layer = LoRALinear(
        dense_linear(weight.to(dev), bias.to(dev)), list(zip(starts, sizes, strict=True)),
        slots, max_rank, dtype, dev, step, make_update(update),
    )  # fmt: skip
    adapters = {}
    for slot, rank in enumerate([2, 6, 3]):
        pieces = []
        for t, size in enumerate(sizes):
            if slot == 2 and t == 1:  # an adapter that leaves a target alone
                pieces.append(None)
                continue
            a = torch.randn(rank, d_in, generator=gen).to(dtype)
            b = torch.randn(size, rank, generator=gen).to(dtype)
            pieces.append((a, b))
        layer.load(slot, [p and (p[0].to(dev), p[1].to(dev)) for p in pieces])
        adapters[slot] = pieces
    rows = 11
    x = torch.randn(rows, d_in, generator=gen).to(dtype)
    token_slots = {
        "scattered": torch.tensor([0, 1, -1, 2, 2, 0, 1, -1, 0, 2, 1]),
        "runs": torch.tensor([2, 2, 2, -1, 0, 0, 1, 1, 1, 1, 0]),
        "one adapter": torch.full((rows,), 1),
        "base only": torch.full((rows,), -1),
    }[layout]
    step.set(token_slots.to(dev))
    runs = layout != "scattered"
    assert all(isinstance(g.rows, slice) == runs for g in step.groups)
    got = layer.forward(x.to(dev))
    assert got.device == dev
    got = got.cpu()
    for i in range(rows):
        want = x[i].double() @ weight.double().T + bias.double()
        slot = int(token_slots[i])
        if slot >= 0:
            for t, piece in enumerate(adapters[slot]):
                if piece is not None:
                    a, b = piece
                    delta = (x[i].double() @ a.double().T) @ b.double().T
                    want[starts[t] : starts[t] + sizes[t]] += delta
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("update", ["torch", "kernel", "triton"])
def test_reloading_a_slot_replaces_the_adapter_whole(update):
    gen = torch.Generator().manual_seed(1)
    step = AdapterStep()
    weight = torch.randn(8, 4, generator=gen)
    dev = device_of(update)
    layer = LoRALinear(dense_linear(weight.to(dev), None), [(0, 8)], 1, 4, torch.float32, dev,
                       step, make_update(update))  # fmt: skip
    big = (torch.randn(4, 4, generator=gen), torch.randn(8, 4, generator=gen))
    layer.load(0, [(big[0].to(dev), big[1].to(dev))])
    small = (torch.randn(1, 4, generator=gen), torch.randn(8, 1, generator=gen))
    # rank 1: the rest of the old rank-4 update must be gone
    layer.load(0, [(small[0].to(dev), small[1].to(dev))])
    x = torch.randn(3, 4, generator=gen)
    step.set(torch.zeros(3, dtype=torch.int64, device=dev))
    want = x @ weight.T + (x @ small[0].T) @ small[1].T
    torch.testing.assert_close(layer.forward(x.to(dev)).cpu(), want)


@pytest.mark.parametrize("update", ["torch", "kernel", "triton"])
def test_one_update_serves_step_after_step(update):
    """The same layer and update over steps whose rows and groups differ (an update may keep
    what it made for a step, never for the next)."""
    gen = torch.Generator().manual_seed(2)
    step = AdapterStep()
    weight = torch.randn(12, 6, generator=gen)
    dev = device_of(update)
    layer = LoRALinear(dense_linear(weight.to(dev), None), [(0, 12)], 2, 3, torch.float32, dev,
                       step, make_update(update))  # fmt: skip
    pieces = [(torch.randn(3, 6, generator=gen), torch.randn(12, 3, generator=gen)) for _ in "ab"]
    for slot, (a, b) in enumerate(pieces):
        layer.load(slot, [(a.to(dev), b.to(dev))])
    for slots in ([0, 0, 1], [1, -1, 1, 0, 0, 0, 1], [1]):
        x = torch.randn(len(slots), 6, generator=gen)
        step.set(torch.tensor(slots, device=dev))
        want = x @ weight.T
        for i, s in enumerate(slots):
            if s >= 0:
                want[i] += (x[i] @ pieces[s][0].T) @ pieces[s][1].T
        got = layer.forward(x.to(dev)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
