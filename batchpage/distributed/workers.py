"""The driver's side of tensor parallelism: rank 0 runs in the engine's process (its scheduler,
radix cache and sampler exist once, there), ranks 1..N-1 elsewhere (worker.py), started and
supervised through `Ranks`: processes of this host (process_ranks.py, backend "mp") or Ray
actors on a placement group's bundles, on any node (ray_ranks.py, backend "ray"), chosen once
from EngineConfig.distributed_executor_backend.

Lifecycle: `start` launches the ranks, which load their shares while the driver loads its
own; `join` waits for every one to say it loaded (or fails with its error), then joins the
group; each step `send` broadcasts the step's ForwardStep, one message, and every rank runs
the same forward, its collectives entered in the same order by all. A rank that dies makes
the next collective fail: `failure` turns that into one error naming the rank. `close` stops
the ranks (also at garbage collection and interpreter exit): ranks waiting for the next step are
told to return; ranks inside a step rank 0 left (Ctrl-C or SIGTERM mid-forward: they wait in a
collective rank 0 will never enter, and any message would be read as that collective's data)
are ended at once, so an interrupted job exits within seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from batchpage.distributed.process_ranks import ProcessRanks
from batchpage.distributed.ray_ranks import RayRanks
from batchpage.distributed.worker import WorkerSpec, to_device
from batchpage.engine.config import EngineConfig
from batchpage.engine.model_runner import ForwardStep
from batchpage.engine.plan import EnginePlan
from batchpage.model.loader import ModelSource
from batchpage.model.shard import TensorShard
from batchpage.ops.collective import GroupCollective, broadcast_object, open_group
from batchpage.ops.shm_collective import shared_memory_collective

# Loading a share of a large checkpoint takes minutes; a worker silent for longer is stuck.
LOAD_TIMEOUT_S = 3600.0
# Closing: how long the None step may take to reach the ranks, then how long the ranks told have
# to return before they are ended (a rank waiting for a step receives it at once).
TELL_S = 2.0
RETURN_S = 3.0


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


@dataclass
class GroupState:
    """What closing needs to know of the group (the finalizer must not hold the workers)."""

    control: dist.ProcessGroup | None = None  # the host-message group, once joined
    in_step: bool = False  # a step was sent that rank 0 has not finished


class Ranks(Protocol):
    """Where ranks 1..world-1 run, and how they are watched."""

    store_host: str  # where rank 0's TCPStore listens, as the ranks reach it
    # Whether a broken group with no rank seen dead still means a rank was lost (a rank on a
    # lost node breaks it before that node is reported gone).
    group_break_is_loss: bool

    def wait_loaded(self, deadline: float) -> str | None:
        """None once every rank has loaded and is joining the group; else why a rank did not."""

    def dead(self) -> list[str]:
        """The ranks that died or stopped, each named with what is known of its end."""

    def nodes(self) -> list[str]:
        """Where each of ranks 1.. runs (a host name, or a Ray node id)."""

    def stop(self, wait_s: float) -> None:
        """Wait up to wait_s for the ranks to return (0: they were not told to), then end those
        still running: asked first, killed when they are still there after a moment."""


class TensorParallelWorkers:
    """Ranks 1..world-1 of the engine's group, and the group itself. Implements the model
    runner's Peers."""

    def __init__(self, ranks: Ranks, store: dist.TCPStore, world: int, threads: int | None) -> None:
        """threads: rank 0's torch threads during a step (None: the process's own)."""
        self.ranks = ranks
        self.store = store
        self.world = world
        self.threads = threads
        self.sent = Sent()
        self.shard = TensorShard(0, world)
        self._comm: GroupCollective | None = None  # set by join
        self._group = GroupState()
        self._finalizer = weakref.finalize(self, _stop, ranks, self._group)

    @property
    def comm(self) -> GroupCollective:
        assert self._comm is not None, "join the group first"
        return self._comm

    @classmethod
    def start(
        cls, source: ModelSource, cfg: EngineConfig, plan: EnginePlan
    ) -> TensorParallelWorkers:
        world = cfg.tensor_parallel_size
        # The store listens on every interface, whatever host it is given.
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        # On a CPU the ranks share the host's cores (or, under Ray, rank 0's share of its
        # replica's): each takes an equal part (rank 0 only while it runs a step: the
        # process's own setting is left as it was).
        threads = max(1, torch.get_num_threads() // world)

        def spec(rank: int, host: str, device: torch.device) -> WorkerSpec:
            return WorkerSpec(source, cfg, plan, rank, world, host, store.port, threads, device)

        ranks: Ranks
        if cfg.distributed_executor_backend == "ray":
            ranks = RayRanks.start(spec, plan, world, threads)
        else:
            ranks = ProcessRanks.start(spec, plan, world)
        return cls(ranks, store, world, threads if plan.device.type == "cpu" else None)

    def join(self, device: torch.device) -> GroupCollective:
        """Wait until every rank has loaded its share, then join the group as rank 0."""
        problem = self.ranks.wait_loaded(time.monotonic() + LOAD_TIMEOUT_S)
        if problem is not None:
            self.close()
            raise WorkerDied(problem)
        forward, control = open_group(self.store, 0, self.world, device, self.ranks.store_host)
        self._group.control = control
        self._comm = shared_memory_collective(self.store, forward, 0, self.world, device)
        return self._comm

    def send(self, step: ForwardStep) -> None:
        assert self._group.control is not None, "join the group before sending steps"
        self._group.in_step = True  # from its first byte: a message cut short is out of step
        start = time.perf_counter()
        size = broadcast_object(self._group.control, to_device(step, torch.device("cpu")), 0)
        self.sent.add(size, time.perf_counter() - start)

    @contextlib.contextmanager
    def rank_threads(self) -> Iterator[None]:
        """Rank 0's threads while it runs a step (sent, then its own forward). Only a step
        that returns here is finished on every rank; one left by an exception (an interrupt)
        leaves the group out of step."""
        before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if self.threads is not None:
                torch.set_num_threads(before)
        self._group.in_step = False

    def failure(self, error: Exception) -> Exception:
        """The error for a failed collective: WorkerDied naming the ranks that died (waiting a
        moment for their end to show), else (where a broken group is a lost rank) WorkerDied
        with the collective's error, else that error."""
        deadline = time.monotonic() + 5.0
        while not (dead := self.ranks.dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not dead and not self.ranks.group_break_is_loss:
            return error
        self.close()
        names = ", ".join(dead) or f"a rank stopped answering ({error})"
        return WorkerDied(
            f"tensor-parallel worker {names} died: this engine stopped; start a new one "
            "(a job resumes where it stopped)"
        )

    def close(self) -> None:
        """Stop the ranks (what garbage collection and interpreter exit also do)."""
        self._finalizer()


def _stop(ranks: Ranks, group: GroupState) -> None:
    """A None step tells live ranks waiting for the next step to return; the others (inside a
    step rank 0 left, blocked in a collective whose peer died, still loading) and any that do
    not return in time are ended."""
    control, group.control = group.control, None
    told = control is not None and not group.in_step and not ranks.dead() and _tell_stop(control)
    ranks.stop(RETURN_S if told else 0.0)


def _tell_stop(control: dist.ProcessGroup) -> bool:
    """Broadcast the None step; False when it failed or took longer than TELL_S (a rank that is
    not receiving: the broadcast, left in its thread, fails once that rank is ended)."""
    sent = threading.Event()

    def tell() -> None:
        with contextlib.suppress(RuntimeError):  # a rank went meanwhile: it is ended anyway
            broadcast_object(control, None, 0)
            sent.set()

    threading.Thread(target=tell, name="batchpage-tp-stop", daemon=True).start()
    return sent.wait(TELL_S)
