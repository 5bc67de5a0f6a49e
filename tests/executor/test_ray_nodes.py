"""executor=ray on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a
head with no CPUs, so every replica runs on a worker node, each node a raylet of its own): a
job of 3 rows on 3 replicas uses all three; a node killed mid-job (its raylet, not the driver)
costs no row; replicas lost with their nodes are replaced on a node added later; a replica of
two tensor-parallel ranks spans two nodes, and losing one of its nodes loses (and replaces) the
replica. Every job's rows are written exactly once and equal an uninterrupted local run's."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchpage.executor.ray_executor import ReplicaPool
from batchpage.job import run_job
from tests.executor.jobs import (
    compared,
    job,
    job_args,
    ray_args,
    run_json,
    shard_indices,
    write_rows,
)

# Nodes are declared dead after missing 3 health checks a second apart (Ray's default takes
# tens of seconds), so a killed node is noticed within a test's patience.
FAST_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}


@pytest.fixture
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="pip install 'batchpage[ray]'")
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": FAST_DEATH},
    )
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def start(cluster: Any, nodes: int) -> list[Any]:
    """Add `nodes` worker nodes of one CPU each and connect this process to the cluster."""
    import ray

    added = [cluster.add_node(num_cpus=1) for _ in range(nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return added


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


class KillsNodes(ReplicaPool):
    """When the first row of the job arrives: removes (kills) the nodes the replicas `victims`
    run on, rank 0's or, with `rank`, that tensor-parallel rank's; then adds `later` nodes of
    one CPU."""

    cluster: Any = None
    victims: tuple[int, ...] = ()
    rank = 0
    later = 0
    added: list[Any] = []

    def _call(self, method: str, keys: Any, columns: Any, kwargs: Any, on_output: Any,
              on_step: Any) -> Any:  # fmt: skip
        doomed = {self.replicas[i].info["rank_nodes"][self.rank] for i in self.victims}
        killed = False

        def killing(out: Any, index: int) -> None:
            nonlocal killed
            if not killed:
                killed = True
                for node in list(self.cluster.worker_nodes):
                    if node.node_id in doomed:
                        kill_node(self.cluster, node)
                self.added.extend(self.cluster.add_node(num_cpus=1) for _ in range(self.later))
            on_output(out, index)

        return super()._call(method, keys, columns, kwargs, killing, on_step)


def killing(cluster: Any, victims: tuple[int, ...], rank: int = 0, later: int = 0) -> type:
    return type(
        "Killing",
        (KillsNodes,),
        {
            "cluster": cluster,
            "victims": victims,
            "rank": rank,
            "later": later,
            "added": [],
        },  # fmt: skip
    )


def local_rows(tmp_path, tiny_folder, data) -> list[dict]:
    run_job(job(job_args(data, tiny_folder, tmp_path / "local")))
    return compared(tmp_path / "local")


def test_three_rows_on_three_replicas_use_every_node(tmp_path, tiny_folder, cluster) -> None:
    nodes = start(cluster, 3)
    data = write_rows(tmp_path / "d.jsonl", 3, bad=False)
    out = tmp_path / "ray"
    run_job(job(job_args(data, tiny_folder, out, *ray_args(3, window_rows=64))))
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)
    replicas = run_json(out)["runs"][-1]["settings"]["executor"]["replicas"]
    assert [r["rows"] for r in replicas] == [1, 1, 1]
    assert {r["node_id"] for r in replicas} == {n.node_id for n in nodes}


@pytest.mark.slow
def test_a_node_killed_mid_job_costs_no_row(tmp_path, tiny_folder, cluster) -> None:
    start(cluster, 2)
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    out = tmp_path / "ray"
    cfg = job(job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(),
                       "executor.max_restarts=0"))  # fmt: skip
    pool = killing(cluster, victims=(1,))
    run_job(cfg, lambda model, **engine: pool(model, cfg.executor, **engine))
    assert sorted(shard_indices(out)) == list(range(24)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    assert [r["lost"] for r in executor["replicas"]] == [False, True]
    assert executor["replicas_lost"] == 1 and executor["windows_redone"] >= 1
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)


@pytest.mark.slow
def test_replicas_lost_with_their_nodes_are_replaced_on_a_node_added_later(
    tmp_path, tiny_folder, cluster
) -> None:
    start(cluster, 2)
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    out = tmp_path / "ray"
    cfg = job(job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(),
                       "executor.max_restarts=1"))  # fmt: skip
    pool = killing(cluster, victims=(0, 1), later=1)
    run_job(cfg, lambda model, **engine: pool(model, cfg.executor, **engine))
    assert sorted(shard_indices(out)) == list(range(24)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    assert executor["replicas_lost"] == 2 and executor["replicas_replaced"] == 1
    replicas = executor["replicas"]
    assert [r["lost"] for r in replicas] == [True, True, False]
    assert replicas[2]["node_id"] == pool.added[0].node_id and replicas[2]["rows"] >= 1
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)


@pytest.mark.slow
def test_a_replica_of_two_ranks_spans_two_nodes_and_is_replaced_when_one_dies(
    tmp_path, tiny_folder, cluster
) -> None:
    """One replica, engine.tensor_parallel_size=2 with a CPU per rank over nodes of one CPU:
    its ranks run on two nodes. Killing rank 1's node breaks the replica's group: the replica
    is lost, and its replacement takes the surviving node's CPU and a node added later."""
    nodes = start(cluster, 2)
    data = write_rows(tmp_path / "d.jsonl", 12, bad=False)
    out = tmp_path / "ray"
    tp = ["engine.tensor_parallel_size=2", "executor.cpus_per_replica=2"]
    cfg = job(job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(1), *tp,
                       "executor.max_restarts=1"))  # fmt: skip
    pool = killing(cluster, victims=(0,), rank=1, later=1)
    run_job(cfg, lambda model, **engine: pool(model, cfg.executor, **engine))
    assert sorted(shard_indices(out)) == list(range(12)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    first, second = executor["replicas"]
    assert sorted(first["rank_nodes"]) == sorted(n.node_id for n in nodes)
    assert first["lost"] and not second["lost"] and second["rows"] >= 1
    assert len(set(second["rank_nodes"])) == 2 and pool.added[0].node_id in second["rank_nodes"]
    assert executor["replicas_replaced"] == 1
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)
