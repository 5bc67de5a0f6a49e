"""The driver's side of tensor parallelism: rank 0 runs in the engine's process (its scheduler,
radix cache and sampler exist once, there), ranks 1..N-1 in worker processes it starts and
supervises (worker.py).

Lifecycle: `start` launches the workers, which load their shares while the driver loads its
own; `join` waits for every one to say it loaded (or fails with its error), then joins the
group; each step `send` broadcasts the step's ForwardStep, one message, and every rank runs
the same forward, its collectives entered in the same order by all. A worker that dies makes
the next collective fail: `failure` turns that into one error naming the rank. `close` stops
the workers (also at garbage collection and interpreter exit).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import torch
import torch.distributed as dist

from batchpage.distributed.worker import LOADED, WorkerSpec, to_device
from batchpage.engine.config import EngineConfig
from batchpage.engine.model_runner import ForwardStep
from batchpage.engine.plan import EnginePlan
from batchpage.model.loader import ModelSource
from batchpage.model.shard import TensorShard
from batchpage.ops.collective import GroupCollective, broadcast_object, open_group

# Loading a share of a large checkpoint takes minutes; a worker silent for longer is stuck.
LOAD_TIMEOUT_S = 3600.0


class WorkerDied(RuntimeError):
    """A tensor-parallel worker exited while its group ran or loaded."""


@dataclass
class Sent:
    """The step messages rank 0 has broadcast: how many, their bytes, the seconds it took."""

    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, size: int, seconds: float) -> None:
        self.messages += 1
        self.bytes += size
        self.seconds += seconds


class TensorParallelWorkers:
    """Ranks 1..world-1 of the engine's group, and the group itself. Implements the model
    runner's Peers."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        store: dist.TCPStore,
        world: int,
        threads: int | None,
    ) -> None:
        """threads: rank 0's torch threads during a step (None: the process's own)."""
        self.procs = procs
        self.store = store
        self.world = world
        self.threads = threads
        self.sent = Sent()
        self.shard = TensorShard(0, world)
        self._comm: GroupCollective | None = None  # set by join
        # [the control group] once joined: what the finalizer tells the workers to stop on.
        self._control: list[dist.ProcessGroup] = []
        self._finalizer = weakref.finalize(self, _stop, procs, self._control)

    @property
    def comm(self) -> GroupCollective:
        assert self._comm is not None, "join the group first"
        return self._comm

    @classmethod
    def start(
        cls, source: ModelSource, cfg: EngineConfig, plan: EnginePlan
    ) -> TensorParallelWorkers:
        world = cfg.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        # On a CPU the ranks share the host's cores: each takes an equal part (rank 0 only
        # while it runs a step: the process's own setting is left as it was).
        threads = max(1, torch.get_num_threads() // world)
        procs = []
        for rank in range(1, world):
            spec = WorkerSpec(source, cfg, plan, rank, world, store.port, threads)
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchpage.distributed.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            procs.append(proc)
        return cls(procs, store, world, threads if plan.device.type == "cpu" else None)

    def join(self, device: torch.device) -> GroupCollective:
        """Wait until every worker has loaded its share, then join the group as rank 0."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for rank, proc in enumerate(self.procs, start=1):
            line = _read_line(proc, deadline)
            if line != LOADED:
                self.close()
                detail = line or f"it exited with {_exit(proc)}"
                raise WorkerDied(f"tensor-parallel rank {rank} failed to load: {detail}")
        forward, control = open_group(self.store, 0, self.world, device)
        self._control.append(control)
        self._comm = GroupCollective(forward, self.world)
        return self._comm

    def send(self, step: ForwardStep) -> None:
        assert self._control, "join the group before sending steps"
        start = time.perf_counter()
        size = broadcast_object(self._control[0], to_device(step, torch.device("cpu")), 0)
        self.sent.add(size, time.perf_counter() - start)

    @contextlib.contextmanager
    def rank_threads(self) -> Iterator[None]:
        if self.threads is None:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def failure(self, error: Exception) -> Exception:
        """The error for a failed collective: WorkerDied naming the ranks that exited (waiting
        a moment for their exit to show), else the collective's own error."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            if dead:
                self.close()
                names = ", ".join(f"rank {r} (pid {p.pid}, {_exit(p)})" for r, p in dead)
                return WorkerDied(
                    f"tensor-parallel worker {names} died: this engine stopped; start a new one "
                    "(a job resumes where it stopped)"
                )
            time.sleep(0.05)
        return error

    def close(self) -> None:
        """Stop the workers (what garbage collection and interpreter exit also do)."""
        self._finalizer()


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


def _stop(procs: list[subprocess.Popen[bytes]], control: list[dist.ProcessGroup]) -> None:
    """A None step tells live workers to return; those that do not (blocked in a collective
    whose peer died, or still loading) are killed."""
    if control and all(p.poll() is None for p in procs):
        with contextlib.suppress(RuntimeError):  # a worker went meanwhile: killed below
            broadcast_object(control[0], None, 0)
    control.clear()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
