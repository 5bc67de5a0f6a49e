"""Host memory for running the engine on a CPU: the allocator's settings, and how much memory
the machine can give (the default KV pool is sized from it).

A decode step allocates and frees the same large temporaries (activations, gathered K/V for
prefill, logits) every layer and every step. glibc serves blocks above its mmap threshold
(128 KiB to start) with fresh mmap()s and unmaps them on free, so every step faults every page
in again and the kernel zeroes it: a decode step then spends much of its time in system calls
and page faults. Raising the mmap and trim thresholds makes glibc keep freed
memory in its heap and hand the same pages back next time. Resident memory then stays at the
step's peak instead of shrinking between steps, which a batch job wants anyway.

This is process-wide (like torch.set_num_threads): it is applied once, when a CPU engine starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
# glibc refuses mmap thresholds above its maximum (32 MiB on 64-bit builds that enforce it):
# try a threshold above any per-step temporary first, then that maximum.
_THRESHOLDS = (1 << 30, 32 << 20)
_TRIM_THRESHOLD = 1 << 36


def keep_freed_memory() -> bool:
    """Ask glibc to reuse freed memory instead of returning it to the OS. Returns whether it was
    applied (False off glibc, e.g. on macOS or musl, where nothing changes)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not any(mallopt(M_MMAP_THRESHOLD, value) == 1 for value in _THRESHOLDS):
        return False
    return mallopt(M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1


@contextmanager
def older_objects_frozen() -> Iterator[None]:
    """While the block runs, Python's cyclic garbage collector leaves the objects that existed
    when it began alone (gc.freeze): a run allocates many short-lived objects per request, and
    each full collection would otherwise walk the interpreter's, torch's, the tokenizer's and
    the engine's objects again, every one of them still alive. Objects made in the block are
    collected as usual; at its end the older ones are handed back (gc.unfreeze), so cycles they
    formed meanwhile (an engine closed in the block) are freed by a later collection. Where
    objects are frozen already (the application froze its own), they stay as they are. Like
    keep_freed_memory this is process-wide; it changes what the collector scans, never what a
    program computes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


MADV_HUGEPAGE = 14  # from linux/mman.h
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with 2 MiB pages (transparent huge pages in
    "madvise" mode, the common default). Call it before the memory is first written: pages
    already faulted in stay 4 KiB. The KV pool is read block by block at random places, and with
    4 KiB pages nearly every block read misses the TLB. Returns whether the advice was taken."""
    if tensor.device.type != "cpu" or tensor.nbytes < 2 * _HUGE_PAGE:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        madvise = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    # madvise wants a page-aligned start: advise the whole huge pages inside the tensor.
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0


SMAPS = Path("/proc/self/smaps")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_advisable(mode: Path | None = None) -> bool:
    """Whether advise_huge_pages gets 2 MiB pages here: transparent huge pages in "always" or
    "madvise" mode (`mode`: the sysfs file, THP_MODE by default)."""
    try:
        chosen = (mode or THP_MODE).read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "madvise")


def resident_bytes(tensors: list[torch.Tensor], smaps: Path | None = None) -> int:
    """The resident bytes of the CPU tensors' memory (the pages written so far of a pool mapped
    untouched), from this process's /proc/self/smaps: each mapping's Rss, pro rata to the part
    of it the tensors cover. 0 where smaps cannot be read."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.nbytes)
    if not spans:
        return 0
    try:
        text = (smaps or SMAPS).read_text()
    except OSError:
        return 0
    total = 0.0
    start = end = 0
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            a, b = head.split("-")
            start, end = int(a, 16), int(b, 16)
        elif head == "Rss:" and end > start:
            covered = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in spans)
            if covered:
                total += int(line.split()[1]) * 1024 * covered / (end - start)
    return int(total)


MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: this process's group, as a container sees it


def available_host_memory(meminfo: Path | None = None, cgroup: Path | None = None) -> int:
    """Bytes this process could allocate without swapping: the kernel's MemAvailable (free
    memory plus the page cache and slabs it would reclaim), never MemFree alone, which drops
    toward zero as the page cache fills after reading a few files. A cgroup v2 memory limit
    (a container's) caps it: the limit less what the group holds, its reclaimable file pages
    not counted. Where /proc/meminfo has no MemAvailable (not Linux, or before 3.14): free
    physical pages. `meminfo` and `cgroup` default to MEMINFO and CGROUP."""
    available = _meminfo_bytes(meminfo or MEMINFO, "MemAvailable")
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = _cgroup_available(cgroup or CGROUP)
    return available if limited is None else min(available, limited)


def _meminfo_bytes(meminfo: Path, field: str) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            number, *unit = value.split()
            return int(number) * (1024 if unit == ["kB"] else 1)
    return None


def _cgroup_available(cgroup: Path) -> int | None:
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        current = int((cgroup / "memory.current").read_text())
        stat = (cgroup / "memory.stat").read_text().splitlines()
    except (OSError, ValueError):
        return None
    if not limit.isdigit():
        return None  # "max": no limit
    fields = dict(line.split(maxsplit=1) for line in stat if " " in line)
    reclaimable = int(fields.get("inactive_file", "0"))
    return max(0, int(limit) - current + reclaimable)
