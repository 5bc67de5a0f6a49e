"""The all-reduce of tensor-parallel CPU ranks on one host, through a shared-memory segment.

gloo sends each all-reduce through the loopback's sockets: a forward's two a layer cost a
system call and a wake-up per message, and a rank that blocks in one sleeps until the kernel
wakes it. Ranks that share a host share its memory instead: each writes its partial sum into
its slot of a segment all of them map, raises its counter to the collective's sequence number,
and waits (polling, then yielding its core) until every rank's counter reaches it; each then
sums the slots in rank order, so every rank holds the same bits. Slots alternate between two
parities: a rank writes parity p at sequence s only after every rank has reached s - 1, which
each does only after it has read sequence s - 2's slots of the same parity.

A tensor larger than a slot goes through the group's gloo all-reduce (a prompt-sized step,
where the wire's latency matters least); every rank takes the same path, by size. A rank that
waits checks now and then that the ranks it waits for are alive (their pids, written in the
segment) and raises naming a dead one, as a broken gloo group would.

The counters are written after the slot they publish; x86's stores are seen by other cores in
the order they were made, which is what this relies on: `shared_memory_collective` offers it
only on x86-64.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from batchpage.ops.collective import TIMEOUT, GroupCollective

SLOT_BYTES = 1 << 20  # a decode step's [rows, hidden] partial sums fit; a prompt's may not
LINE = 8  # int64s per rank's header line (64 bytes: ranks' counters on lines of their own)
SPINS = 20_000  # polls before a waiting rank starts yielding its core
CHECK_S = 0.5  # how often a waiting rank checks that the ranks it waits for are alive


class SharedMemoryCollective(GroupCollective):
    """A GroupCollective whose all-reduce of a tensor that fits a slot goes through `segment`;
    the rest (larger all-reduces, the logits gather) through the gloo group."""

    def __init__(self, group: dist.ProcessGroup, world: int, rank: int, segment: mmap.mmap) -> None:
        super().__init__(group, world)
        self.rank, self.segment = rank, segment  # the mapping lives as long as this object
        header = world * LINE * 8
        assert len(segment) == header + 2 * world * SLOT_BYTES, len(segment)
        self.lines = np.frombuffer(segment, dtype=np.int64, count=world * LINE).reshape(world, LINE)
        data = torch.frombuffer(segment, dtype=torch.uint8, offset=header)
        self.slots = data.view(2, world, SLOT_BYTES)
        self.lines[rank, 1] = os.getpid()
        self.seq = 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or not x.is_contiguous():
            return super().all_reduce_(x)
        self.seq += 1
        slots = self.slots[self.seq & 1, :, :nbytes].view(x.dtype).view(self.world, *x.shape)
        slots[self.rank].copy_(x)
        self.lines[self.rank, 0] = self.seq  # after the slot: published
        self._wait(self.seq)
        x.copy_(slots[0])
        for r in range(1, self.world):
            x.add_(slots[r])
        return x

    def _wait(self, seq: int) -> None:
        counters = self.lines[:, 0]
        polls = 0
        start = last_check = time.monotonic()
        while counters.min() < seq:
            polls += 1
            if polls < SPINS:
                continue
            os.sched_yield()  # more ranks than cores: let the one we wait for run
            now = time.monotonic()
            if now - last_check > CHECK_S:
                last_check = now
                self._check_alive(seq, now - start)

    def _check_alive(self, seq: int, waited: float) -> None:
        for r in range(self.world):
            if self.lines[r, 0] < seq and not _alive(int(self.lines[r, 1])):
                raise RuntimeError(f"tensor-parallel rank {r} ended during an all-reduce")
        if waited > TIMEOUT.total_seconds():
            raise RuntimeError(f"an all-reduce waited {waited:.0f} s for a tensor-parallel rank")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return pid == 0  # not written yet: that rank has not attached
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"


def shared_memory_collective(
    store: dist.Store, group: dist.ProcessGroup, rank: int, world: int, device: torch.device
) -> GroupCollective:
    """The forward's collective for a group every rank joins: a SharedMemoryCollective where
    every rank is a CPU rank on this x86-64 host, else the gloo (or NCCL) group's. Every rank
    must call it, in the same group; rank 0 creates the segment, the others map it (or decline:
    then every rank keeps the group's), and it is unlinked once all have answered."""
    offer = device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
    size = world * LINE * 8 + 2 * world * SLOT_BYTES
    if rank == 0:
        path = Path("/dev/shm") / f"batchpage-tp-{uuid.uuid4().hex}"
        segment = _create(path, size) if offer and path.parent.is_dir() else None
        try:
            store.set("shm/offer", f"{path}\n{_host_id()}" if segment is not None else "")
            answers = [store.get(f"shm/answer/{r}").decode() for r in range(1, world)]
        finally:
            if segment is not None:  # every rank that was to map it has answered (or failed)
                path.unlink(missing_ok=True)
        use = segment is not None and all(a == "mapped" for a in answers)
        store.set("shm/use", "1" if use else "0")
        if use:
            assert segment is not None
            return SharedMemoryCollective(group, world, 0, segment)
        return GroupCollective(group, world)
    offer_text = store.get("shm/offer").decode()
    segment = None
    if offer_text and device.type == "cpu":
        path, host = offer_text.split("\n", 1)
        if host == _host_id():
            segment = _map(Path(path), size)
    store.set(f"shm/answer/{rank}", "mapped" if segment is not None else "declined")
    if store.get("shm/use").decode() == "1":
        assert segment is not None
        return SharedMemoryCollective(group, world, rank, segment)
    return GroupCollective(group, world)


def _create(path: Path, size: int) -> mmap.mmap | None:
    """A new zeroed segment of `size` bytes at `path`, its pages reserved now (a full /dev/shm,
    a container's 64 MiB, says so here rather than as a SIGBUS at the first write); None where
    it cannot be made (the file is then gone)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)


def _map(path: Path, size: int) -> mmap.mmap | None:
    """Rank 0's segment mapped here; None where this rank cannot see it (a host name and boot
    shared by containers whose /dev/shm differ)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, size) if os.fstat(fd).st_size == size else None
    finally:
        os.close(fd)
