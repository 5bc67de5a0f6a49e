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
from batchpage.simulate.memory import Pool, peak_resident_bytes, touched_pool_bytes

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


def test_a_child_processs_peak_is_its_own_not_its_parents() -> None:
    """peak_resident_bytes in a process started from this one (vfork then exec, as subprocess
    does) against this process's written pages: wait4's ru_maxrss for the same kind of child
    counts them (the reason the job reports its own), peak_resident_bytes does not, and it is at
    least the child's own written buffer."""
    import os
    import subprocess

    parent_bytes = 512 << 20
    held = bytearray(parent_bytes)
    for i in range(0, parent_bytes, PAGE):
        held[i] = 1
    code = (
        "from batchpage.simulate.memory import peak_resident_bytes; "
        "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print(peak_resident_bytes())"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out = child.stdout.read() if child.stdout else ""
    _, status, usage = os.wait4(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    peak = int(out.strip())
    assert usage.ru_maxrss * 1024 > parent_bytes  # the parent's pages, in the child's count
    assert 64 << 20 < peak < parent_bytes
    del held


def test_peak_resident_bytes_reads_vmhwm(tmp_path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t 900 kB\nVmHWM:\t  1234 kB\nVmRSS:\t 1000 kB\n")
    assert peak_resident_bytes(status) == 1234 * 1024
    status.write_text("Name:\tpython\n")
    assert peak_resident_bytes(status) is None
    assert peak_resident_bytes(tmp_path / "missing") is None
