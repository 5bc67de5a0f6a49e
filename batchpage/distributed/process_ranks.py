"""Ranks 1..N-1 as processes of this host (distributed_executor_backend="mp"): each a
`python -m batchpage.distributed.worker` child with its WorkerSpec pickled on stdin, on CUDA
device (the driver's + rank) or sharing the host's cores. Implements workers.py's Ranks."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

import torch

from batchpage.distributed.worker import LOADED, WorkerSpec, rank_device
from batchpage.engine.plan import EnginePlan, ranks_over_cores

log = logging.getLogger(__name__)

TERM_S = 2.0  # from SIGTERM to SIGKILL for a rank that is still running


class ProcessRanks:
    """The worker processes, in rank order from 1."""

    store_host = "127.0.0.1"
    # A rank that died is seen as an exited process: a broken group with every process alive
    # is the collective's own error.
    group_break_is_loss = False

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs

    @classmethod
    def start(
        cls, spec: Callable[[int, str, torch.device], WorkerSpec], plan: EnginePlan, world: int
    ) -> ProcessRanks:
        """spec(rank, store_host, device): that rank's WorkerSpec."""
        crowded = ranks_over_cores(world) if plan.device.type == "cpu" else None
        if crowded is not None:
            log.warning(crowded)
        procs = []
        for rank in range(1, world):
            worker = spec(rank, cls.store_host, rank_device(plan, rank))
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchpage.distributed.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": str(worker.threads)},
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(worker))
            proc.stdin.close()
            procs.append(proc)
        return cls(procs)

    def wait_loaded(self, deadline: float) -> str | None:
        """None once every rank has loaded and is joining the group; else why a rank did not."""
        for rank, proc in enumerate(self.procs, start=1):
            line = _read_line(proc, deadline)
            if line != LOADED:
                detail = line or f"it exited with {_exit(proc)}"
                return f"tensor-parallel rank {rank} failed to load: {detail}"
        return None

    def dead(self) -> list[str]:
        """The ranks that exited, each named with its pid and how it ended."""
        return [
            f"rank {r} (pid {p.pid}, {_exit(p)})"
            for r, p in enumerate(self.procs, start=1)
            if p.poll() is not None
        ]

    def nodes(self) -> list[str]:
        """Where ranks 1.. run: this host, each."""
        return [os.uname().nodename] * len(self.procs)

    def stop(self, wait_s: float) -> None:
        """Wait up to wait_s for the ranks to return (told to, or their group broke), then
        SIGTERM those still running (a rank blocked in a collective ends at once: it keeps the
        default action) and SIGKILL any still there TERM_S later."""
        _wait_all(self.procs, wait_s)
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in _wait_all(self.procs, TERM_S):
            proc.kill()
            proc.wait()
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()


def _wait_all(
    procs: list[subprocess.Popen[bytes]], timeout_s: float
) -> list[subprocess.Popen[bytes]]:
    """Wait up to timeout_s, all together, for the processes to exit; those still running."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return [proc for proc in procs if proc.poll() is None]


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    """The worker's next stdout line ('' when it exited first or the deadline passed)."""
    out: IO[bytes] | None = proc.stdout
    assert out is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([out], [], [], 0.5)
        if ready:
            return out.readline().decode(errors="replace").strip()
        if proc.poll() is not None:
            return ""
    return ""


def _exit(proc: subprocess.Popen[bytes]) -> str:
    code = proc.poll()
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
