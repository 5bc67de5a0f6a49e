"""Ranks 1..N-1 as Ray actors (distributed_executor_backend="ray"), each on a bundle of a Ray
placement group, so that one engine's ranks may span nodes. Implements workers.py's Ranks.

Inside a replica of executor=ray the group is the replica's own: bundle 0 holds rank 0 (the
replica's actor), bundles 1.. its other ranks. An LLM made outside any placement group makes
one for its ranks 1.. (each bundle rank 0's share of its CPUs, and a GPU on CUDA), removed at
close; it joins the Ray instance the process is connected to, or starts a local one. The rank
actors are this process's children: Ray ends them when it dies.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from batchpage.distributed.worker import WorkerSpec, load_share, run_steps
from batchpage.engine.plan import EnginePlan

# The longest an engine's own placement group may wait for the cluster to have room.
_PLACE_TIMEOUT_S = 120.0


class RankActor:
    """One rank's process (wrapped by ray.remote in RayRanks.start)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.model: torch.nn.Module | None = None

    def load(self) -> str:
        """Load this rank's share; the id of the node it runs on."""
        import ray

        self.model = load_share(self.spec)
        return str(ray.get_runtime_context().get_node_id())

    def serve(self) -> None:
        """Run the driver's steps until it sends None (RuntimeError if the group breaks)."""
        import ray

        assert self.model is not None, "load first"
        run_steps(self.spec, self.model, ray.util.get_node_ip_address())


class RayRanks:
    """The rank actors, in rank order from 1."""

    # A rank on a lost node breaks the group before Ray has noticed the node is gone: for this
    # engine a broken group is a lost rank either way.
    group_break_is_loss = True

    def __init__(self, actors: list[Any], loads: list[Any], store_host: str, owned: Any) -> None:
        self.actors = actors
        self.loads = loads  # each actor's load() reference
        self.serving: list[Any] = []  # each actor's serve() reference, once loaded
        self.node_ids: list[str] = []
        self.store_host = store_host
        self.owned = owned  # the placement group this engine made, or None

    @classmethod
    def start(
        cls,
        spec: Callable[[int, str, torch.device], WorkerSpec],
        plan: EnginePlan,
        world: int,
        threads: int,
    ) -> RayRanks:
        """spec(rank, store_host, device): that rank's WorkerSpec. ValueError when the current
        placement group has fewer than `world` bundles."""
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray_init(include_dashboard=False, logging_level="WARNING")
        group, owned, first = get_current_placement_group(), None, 1
        if group is None:
            bundle = {"CPU": float(threads), **({"GPU": 1.0} if plan.device.type == "cuda" else {})}
            group = owned = placement_group([bundle] * (world - 1), strategy="PACK")
            first = 0
            if not group.wait(_PLACE_TIMEOUT_S):
                ray.util.remove_placement_group(group)
                raise ValueError(
                    f"the Ray cluster has no room for tensor-parallel ranks 1..{world - 1} "
                    f"({bundle} each) after {_PLACE_TIMEOUT_S:g} s: add nodes or lower "
                    "tensor_parallel_size"
                )
        elif len(group.bundle_specs) < world:
            raise ValueError(
                f"tensor_parallel_size={world} needs a placement group of {world} bundles; this "
                f"process's has {len(group.bundle_specs)}"
            )
        host = ray.util.get_node_ip_address()
        # Ray shows each rank only its own GPU.
        device = torch.device("cuda", 0) if plan.device.type == "cuda" else plan.device
        remote = ray.remote(RankActor)
        actors = []
        for rank in range(1, world):
            index = first + rank - 1
            bundle = group.bundle_specs[index]
            actors.append(
                remote.options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
                ).remote(spec(rank, host, device))
            )
        return cls(actors, [a.load.remote() for a in actors], host, owned)

    def wait_loaded(self, deadline: float) -> str | None:
        """None once every rank has loaded and is joining the group; else why a rank did not."""
        import ray

        timeout = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(self.loads, num_returns=len(self.loads), timeout=timeout)
        for rank, ref in enumerate(self.loads, start=1):
            if ref not in ready:
                return f"tensor-parallel rank {rank} did not load in time"
            try:
                self.node_ids.append(ray.get(ref))
            except ray.exceptions.RayError as e:
                return f"tensor-parallel rank {rank} failed to load: {ray_cause(e)}"
        self.serving = [a.serve.remote() for a in self.actors]
        return None

    def dead(self) -> list[str]:
        """The ranks whose actor died or whose steps stopped, each with what Ray said."""
        import ray

        if not ray.is_initialized():  # shut down (interpreter exit): no rank is left
            return [f"rank {rank} (Ray shut down)" for rank in range(1, len(self.loads) + 1)]
        refs = self.serving or self.loads
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        gone = []
        for rank, ref in enumerate(refs, start=1):
            if ref in ready:
                try:
                    ray.get(ref)
                    gone.append(f"rank {rank} (returned)")
                except ray.exceptions.RayError as e:
                    gone.append(f"rank {rank} ({ray_cause(e)})")
        return gone

    def nodes(self) -> list[str]:
        """The Ray node id each of ranks 1.. runs on."""
        return list(self.node_ids)

    def stop(self, wait_s: float) -> None:
        """Wait up to wait_s for the ranks to return (told to, or their group broke), then end
        the actors and the placement group this engine made."""
        import ray

        with contextlib.suppress(Exception):  # Ray may already be shut down (interpreter exit)
            if self.serving and wait_s > 0:
                ray.wait(self.serving, num_returns=len(self.serving), timeout=wait_s)
            for actor in self.actors:
                ray.kill(actor)
            if self.owned is not None:
                ray.util.remove_placement_group(self.owned)
        self.actors, self.owned = [], None


def ray_init(**kwargs: Any) -> None:
    """ray.init(**kwargs), the process's SIGTERM handler kept: called from the main thread,
    ray.init puts in its own, which exits at once (status 15, or an abort in Ray's teardown),
    where a job's (run.py) saves its rows, ends the replicas and exits 143."""
    import ray

    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**kwargs)
    finally:
        if threading.current_thread() is threading.main_thread() and handler is not None:
            signal.signal(signal.SIGTERM, handler)


def ray_cause(error: Exception) -> str:
    """The first line of what went wrong inside Ray's wrapper."""
    cause = getattr(error, "cause", None) or error
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]
