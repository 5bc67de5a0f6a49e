"""The C++ LoRA kernel (its build for this CPU and its plain loops) against its float64
reference (kernels/cpu_lora.py), row by row."""

from __future__ import annotations

import pytest
import torch

from batchpage.kernels.cpu_build import build_extension
from batchpage.kernels.cpu_lora import SOURCE, CpuLoRA, reference_apply


@pytest.fixture(scope="module", params=["native", "plain"])
def kernel(request) -> CpuLoRA:
    """The build for this CPU, and the plain loops a CPU without AVX2 runs."""
    if request.param == "native":
        return CpuLoRA.build()
    return CpuLoRA(build_extension(SOURCE, "batchpage_cpu_lora", "the LoRA kernel", isa="portable"))


def case(dtype, seed, rows_order="runs"):
    gen = torch.Generator().manual_seed(seed)
    t, d_in, slots, rank = 13, 40, 3, 5
    sizes, starts = [300, 24, 24], [0, 300, 324]  # 300: a chunk of 256 and a remainder
    x = torch.randn(t, d_in, generator=gen).to(dtype)
    y = torch.randn(t, 360, generator=gen).to(dtype)
    a = torch.randn(slots, 3 * rank, d_in, generator=gen).to(dtype)
    bt = [torch.randn(slots, rank, s, generator=gen).to(dtype) for s in sizes]
    active = torch.tensor([[True, True, True], [True, False, True], [False, True, False]])
    if rows_order == "runs":
        rows = torch.arange(t)
        groups = torch.tensor([[2, 0, 3], [0, 3, 7], [1, 8, 12], [0, 12, 13]])  # row 7: base
    else:
        rows = torch.tensor([5, 0, 9, 2, 11, 7, 3, 12])
        groups = torch.tensor([[1, 0, 3], [0, 3, 6], [2, 6, 8]])
    return y, x, a, bt, starts, rows, groups, active


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_order", ["runs", "gathered"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_float64_reference(kernel, dtype, rows_order, threads):
    y, *rest = case(dtype, seed=1, rows_order=rows_order)
    want = reference_apply(y, *rest)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.apply(y, *rest)
    finally:
        torch.set_num_threads(before)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the sum into bf16
        torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=8e-2)


def test_a_corrupted_layout_fails_the_reference_check(kernel):
    """The test can fail: an inactive target taken as active, or B not transposed, differ."""
    y, x, a, bt, starts, rows, groups, active = case(torch.float32, seed=2)
    want = reference_apply(y, x, a, bt, starts, rows, groups, active)
    wrong = active.clone()
    wrong[2, 0] = True
    kernel.apply(y, x, a, bt, starts, rows, groups, wrong)
    assert not torch.allclose(y.double(), want, atol=1e-3)


def test_launcher_refuses_bad_shapes(kernel):
    y, x, a, bt, starts, rows, groups, active = case(torch.float32, seed=3)
    with pytest.raises(AssertionError):
        kernel.apply(y, x, a, bt, starts, rows + 13, groups, active)
    with pytest.raises(AssertionError):
        kernel.apply(y, x.to(torch.bfloat16), a, bt, starts, rows, groups, active)
    with pytest.raises(AssertionError):
        kernel.apply(y, x, a, bt, [0, 300, 340], rows, groups, active)
