"""The Triton LoRA kernels (kernels/lora_update.py), on CUDA where there is one (else run by
Triton's interpreter on the CPU), against the float64 reference of their contract
(kernels/cpu_lora.py, on the CPU), row by row."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.cpu_lora import reference_apply
from batchpage.kernels.lora_update import lora_apply
from tests.kernels.test_cpu_lora import case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(args: tuple) -> list:
    """The kernel's arguments on DEVICE (tensors, and lists of them; the rest as they are)."""

    def move(a: object) -> object:
        if isinstance(a, torch.Tensor):
            return a.to(DEVICE)
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return [t.to(DEVICE) for t in a]
        return a

    return [move(a) for a in args]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_order", ["runs", "gathered"])
def test_triton_kernels_match_the_float64_reference(dtype, rows_order):
    y, *rest = case(dtype, seed=4, rows_order=rows_order)
    want = reference_apply(y, *rest)
    y, *rest = on_device((y, *rest))
    lora_apply(y, *rest)
    y = y.cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=8e-2)


def test_a_group_longer_than_a_tile_and_an_idle_target():
    """40 rows of one adapter (three 16-row tiles), a target its slot leaves alone untouched."""
    gen = torch.Generator().manual_seed(5)
    t, d_in, rank = 40, 70, 3
    y = torch.randn(t, 50, generator=gen)
    x = torch.randn(t, d_in, generator=gen)
    a = torch.randn(2, 2 * rank, d_in, generator=gen)
    bt = [torch.randn(2, rank, 30, generator=gen), torch.randn(2, rank, 20, generator=gen)]
    active = torch.tensor([[True, True], [True, False]])
    rows, groups = torch.arange(t), torch.tensor([[1, 0, t]])
    before = y.clone()
    want = reference_apply(y, x, a, bt, [0, 30], rows, groups, active)
    y_dev, *rest = on_device((y, x, a, bt, [0, 30], rows, groups, active))
    lora_apply(y_dev, *rest)
    y = y_dev.cpu()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[:, 30:], before[:, 30:])
