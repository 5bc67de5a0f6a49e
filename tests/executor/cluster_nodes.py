"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head with no CPUs, so
every replica runs on a worker node, each node a raylet of its own) and the loss of whole nodes
mid-job, for the tests and for jobs/bench/ray_nodes.py; a process's descendants and which of
them still run (tests/distributed/test_signals.py, jobs/bench/reliability.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from batchpage.executor.ray_executor import ReplicaPool

# Nodes declared dead after missing 3 health checks a second apart: a node that stops answering
# without closing its sockets (a lost network) is noticed within a test's patience. Ray's
# default waits several times longer.
FAST_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


def start_cluster(nodes: int, system_config: dict[str, Any] | None = None) -> Any:
    """A Cluster of a CPU-less head and `nodes` nodes of one CPU each, this process joined."""
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "include_dashboard": False}
    if system_config is not None:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return cluster


def kill_node(cluster: Any, node: Any) -> None:
    """Every process of the node at once, as when its machine is lost: the raylet's descendants
    (the workers: replicas, ranks), SIGKILLed, then the node itself (raylet, object store).
    Removing the node alone leaves its workers running for a while, still streaming rows."""
    raylet = node.all_processes["raylet"][0].process.pid
    for pid in descendants(raylet):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)


def descendants(pid: int) -> list[int]:
    """The processes below pid, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # The parent is the 2nd field after the command, which may hold spaces.
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def running(pids: list[int]) -> list[int]:
    """The pids among `pids` still running (a zombie, ended but not yet reaped, is not)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
    return alive


class KillsNodes(ReplicaPool):
    """When the `after`-th row of the job arrives: kills the nodes the replicas `victims` run
    on (rank 0's or, with `rank`, that tensor-parallel rank's), then adds `later` nodes of one
    CPU. Records when (time.monotonic()) it killed, when the driver first counted a victim
    lost, and when a replacement delivered its first row."""

    cluster: Any = None
    victims: tuple[int, ...] = ()
    rank = 0
    after = 1
    later = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.added: list[Any] = []
        self.killed_at: float | None = None
        self.lost_at: float | None = None
        self.replacement_row_at: float | None = None

    def _call(self, method: str, keys: Any, columns: Any, kwargs: Any, on_output: Any,
              on_step: Any, named: Any = None) -> Any:  # fmt: skip
        first = len(self.replicas)
        doomed = {self.replicas[i].info["rank_nodes"][self.rank] for i in self.victims}
        rows = 0

        def watch() -> None:
            now = time.monotonic()
            if self.lost_at is None and any(self.replicas[i].lost for i in self.victims):
                self.lost_at = now
            if self.replacement_row_at is None and any(r.rows for r in self.replicas[first:]):
                self.replacement_row_at = now

        def killing(out: Any, index: int) -> None:
            nonlocal rows
            rows += 1
            if rows == self.after:
                self.killed_at = time.monotonic()
                for node in list(self.cluster.worker_nodes):
                    if node.node_id in doomed:
                        kill_node(self.cluster, node)
                self.added += [self.cluster.add_node(num_cpus=1) for _ in range(self.later)]
            watch()
            on_output(out, index)

        def stepped(stats: Any) -> None:
            watch()
            if on_step is not None:
                on_step(stats)

        return super()._call(method, keys, columns, kwargs, killing, stepped, named)


def killing(cluster: Any, victims: tuple[int, ...], **settings: Any) -> type[KillsNodes]:
    """A KillsNodes class for this cluster and victims (rank, after, later as its fields)."""
    return type("Killing", (KillsNodes,), {"cluster": cluster, "victims": victims, **settings})
