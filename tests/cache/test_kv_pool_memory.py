"""A CPU KV pool costs nothing at setup: its pages are zero, and none is touched until a block
on it is written (a pool of gigabytes written with zeros made the engine's setup fault in every
page before the first step)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest
import torch

from batchpage.cache.kv_cache import KVCache

STATM = Path("/proc/self/statm")


def resident_bytes() -> int:
    """This process's resident memory, from Linux's /proc/self/statm (in pages)."""
    return int(STATM.read_text().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_pool_is_zero_and_untouched_until_written():
    layers, blocks, block_size, heads, dim = 2, 4096, 16, 4, 64
    before = resident_bytes()
    kv = KVCache.allocate(layers, blocks, block_size, heads, dim, torch.bfloat16, "cpu")
    grown = resident_bytes() - before
    pool = sum(t.nbytes for t in (*kv.k, *kv.v))
    assert pool == 2 * layers * blocks * block_size * heads * dim * 2
    assert grown < pool / 16, (grown, pool)  # setup wrote none of it
    for t in (*kv.k, *kv.v):
        assert t.shape == (blocks, block_size, heads, dim) and t.is_contiguous()
        assert not t.any()
    kv.k[1][7].fill_(1.5)
    kv.copy_block(7, 9)
    assert bool((kv.k[1][9] == 1.5).all()) and not kv.k[1][8].any() and not kv.v[1][9].any()
    out, _ = kv.swap_out([9])
    assert bool((out[1] == 1.5).all())


def test_an_empty_pool_allocates():
    kv = KVCache.allocate(1, 0, 16, 2, 8, torch.float32, "cpu")
    assert kv.k[0].shape == (0, 16, 2, 8) and kv.num_blocks == 0
