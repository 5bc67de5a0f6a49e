"""The KV pool's resident pages as the memory model counts them (simulate/memory.py
touched_pool_bytes) against what the kernel reports for a real pool (host_memory.resident_bytes,
from /proc/self/smaps), and resident_bytes itself against pages written by hand."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from batchpage.cache.kv_cache import KVCache
from batchpage.host_memory import huge_pages_advisable, resident_bytes
from batchpage.simulate.memory import Pool, touched_pool_bytes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps is Linux's")
PAGE = mmap.PAGESIZE


def test_resident_bytes_counts_the_pages_written() -> None:
    """A mapping of 64 small pages: written at 3 pages, 3 pages resident. (Advised against huge
    pages, so that the kernel keeps it apart from a neighbouring anonymous mapping, which
    resident_bytes would share its count with pro rata.)"""
    memory = mmap.mmap(-1, 64 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(memory, dtype=torch.uint8)
    assert resident_bytes([t]) == 0
    for page in (0, 17, 63):
        t[page * PAGE + 5] = 1
    assert resident_bytes([t]) == 3 * PAGE
    del t
    memory.close()


@pytest.mark.parametrize("blocks", [1, 7, 40, 200])
def test_a_pools_first_blocks_cost_what_the_model_says(blocks: int) -> None:
    """A 4-layer pool of 256 blocks of 32 KiB per tensor, its first `blocks` blocks written
    in every layer (the pool hands them out first in, first out): the resident bytes within a
    page of the model per tensor (a huge page where huge pages are advised: a mapping's start
    is rarely on a huge page's boundary, so its first pages are small ones)."""
    layers, num_blocks, block_size, heads, dim = 4, 256, 16, 4, 128
    kv = KVCache.allocate(layers, num_blocks, block_size, heads, dim, torch.float32, "cpu")
    tensors = [*kv.k, *kv.v]
    assert resident_bytes(tensors) == 0
    for t in tensors:
        t[:blocks].fill_(1.0)
    per_tensor = block_size * heads * dim * 4
    pool = Pool(num_blocks, per_tensor * len(tensors), 4096, 256, torch.float32)
    huge = huge_pages_advisable()
    modelled = touched_pool_bytes(pool, blocks, len(tensors), huge)
    slack = (2 << 20 if huge else PAGE) * len(tensors)
    measured = resident_bytes(tensors)
    assert blocks * per_tensor * len(tensors) <= measured
    assert abs(measured - modelled) <= slack
    if not huge:
        assert modelled == blocks * per_tensor * len(tensors)
