"""IntWeight's dequantization, which a bind runs on every layer held dense: the values W = s * q
+ o element by element, and no wider temporaries than the result (an int32 copy of every q, then
float copies for the pad, the product and the sum, made a bind dequantize at a fraction of the
memory's speed)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from batchpage.quant.int_weight import IntWeight, pack_nibbles


def random_weight(bits: int, n: int, k: int, group: int, gen: torch.Generator) -> IntWeight:
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=gen) + 0.5
    offsets = torch.randn(n, groups, generator=gen)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, group, k)


def reference(w: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """W[n, k] = s[n, k // group] * q[n, k] + o[n, k // group] in `dtype`, q read from its byte
    (4 bits: k even in the low nibble, k odd in the high one) column by column."""
    cols = torch.arange(w.in_features)
    if w.storage_bits == 4:
        q = (w.packed[:, cols // 2].long() >> (4 * (cols % 2))) & 0xF
    else:
        q = w.packed.long()
    groups = cols // w.group_size
    return w.scales.to(dtype)[:, groups] * q.to(dtype) + w.offsets.to(dtype)[:, groups]


@pytest.mark.parametrize(
    ("bits", "n", "k", "group"),
    [(4, 64, 256, 32), (4, 33, 70, 32), (4, 8, 35, 16), (8, 40, 96, 32), (6, 5, 100, 128)],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dequantize_is_each_value_scaled_and_offset(bits, n, k, group, dtype):
    w = random_weight(bits, n, k, group, torch.Generator().manual_seed(bits * 1000 + k))
    got = w.dequantize_stored(dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, reference(w, dtype))
    ids = torch.tensor([n - 1, 0])
    assert torch.equal(w.dequantize_rows(ids), reference(w, torch.float32)[ids])


def allocated_bytes(run) -> int:
    """Bytes the CPU allocator hands out while `run()` runs, freed or not."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_allocates_little_beyond_its_result(bits):
    n, k = 512, 576
    w = random_weight(bits, n, k, 32, torch.Generator().manual_seed(bits))
    result = n * k * 4  # float32 [N, K]
    # the result, the q unpacked into bytes (with a 4-bit weight's two nibble halves), and a
    # page for the allocator's small change
    bound = result + 2 * n * k + 4096
    assert allocated_bytes(lambda: w.dequantize_stored(torch.float32)) <= bound
