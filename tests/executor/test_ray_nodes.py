"""executor=ray on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a
head with no CPUs, so every replica runs on a worker node, each node a raylet of its own): a
job of 3 rows on 3 replicas uses all three; a node killed mid-job (its raylet, not the driver)
costs no row; replicas lost with their nodes are replaced on a node added later; a replica of
two tensor-parallel ranks spans two nodes, and losing one of its nodes loses (and replaces) the
replica. Every job's rows are written exactly once and equal an uninterrupted local run's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from batchpage.job import run_job
from tests.executor.cluster_nodes import FAST_DEATH, killing, start_cluster
from tests.executor.jobs import (
    compared,
    job,
    job_args,
    ray_args,
    run_json,
    shard_indices,
    write_rows,
)
from tests.extras import require


@pytest.fixture
def cluster(request) -> Iterator[Any]:
    """Nodes as the test's `nodes` mark says (node deaths noticed fast: FAST_DEATH)."""
    ray = require("ray", "ray")
    assert not ray.is_initialized()
    nodes = start_cluster(request.node.get_closest_marker("nodes").args[0], FAST_DEATH)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def local_rows(tmp_path, tiny_folder, data) -> list[dict]:
    run_job(job(job_args(data, tiny_folder, tmp_path / "local")))
    return compared(tmp_path / "local")


@pytest.mark.nodes(3)
def test_three_rows_on_three_replicas_use_every_node(tmp_path, tiny_folder, cluster) -> None:
    nodes = cluster.worker_nodes
    data = write_rows(tmp_path / "d.jsonl", 3, bad=False)
    out = tmp_path / "ray"
    run_job(job(job_args(data, tiny_folder, out, *ray_args(3, window_rows=64))))
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)
    replicas = run_json(out)["runs"][-1]["settings"]["executor"]["replicas"]
    assert [r["rows"] for r in replicas] == [1, 1, 1]
    assert {r["node_id"] for r in replicas} == {n.node_id for n in nodes}


@pytest.mark.slow
@pytest.mark.nodes(2)
def test_a_node_killed_mid_job_costs_no_row(tmp_path, tiny_folder, cluster) -> None:
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
@pytest.mark.nodes(2)
def test_replicas_lost_with_their_nodes_are_replaced_on_a_node_added_later(
    tmp_path, tiny_folder, cluster
) -> None:
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    out = tmp_path / "ray"
    # Until Ray notices a killed node is gone, a replacement may be placed there and fail to
    # start; that counts against max_restarts.
    cfg = job(job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(),
                       "executor.max_restarts=3"))  # fmt: skip
    before = list(cluster.worker_nodes)
    pool = killing(cluster, victims=(0, 1), later=1)
    made = []
    run_job(cfg, lambda model, **engine: made.append(pool(model, cfg.executor, **engine))
            or made[-1])  # fmt: skip
    assert made[0].replica_line() == "1/3 live, 2 lost"  # what the progress bar showed last
    assert sorted(shard_indices(out)) == list(range(24)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    assert executor["replicas_lost"] == 2 and executor["replicas_replaced"] >= 1
    replicas = executor["replicas"]
    assert [r["lost"] for r in replicas] == [True, True, False]
    (added,) = [n for n in cluster.worker_nodes if n not in before]
    assert replicas[2]["node_id"] == added.node_id and replicas[2]["rows"] >= 1
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)


@pytest.mark.slow
@pytest.mark.nodes(2)
def test_a_replica_of_two_ranks_spans_two_nodes_and_is_replaced_when_one_dies(
    tmp_path, tiny_folder, cluster
) -> None:
    """One replica, engine.tensor_parallel_size=2 with a CPU per rank over nodes of one CPU:
    its ranks run on two nodes. Killing rank 1's node breaks the replica's group: the replica
    is lost, and its replacement takes the surviving node's CPU and a node added later."""
    nodes = list(cluster.worker_nodes)
    data = write_rows(tmp_path / "d.jsonl", 12, bad=False)
    out = tmp_path / "ray"
    tp = ["engine.tensor_parallel_size=2", "executor.cpus_per_replica=2"]
    cfg = job(job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(1), *tp,
                       "executor.max_restarts=3"))  # fmt: skip
    pool = killing(cluster, victims=(0,), rank=1, later=1)
    run_job(cfg, lambda model, **engine: pool(model, cfg.executor, **engine))
    assert sorted(shard_indices(out)) == list(range(12)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    first, *_, second = executor["replicas"]  # a replacement may fail on the dying node
    assert sorted(first["rank_nodes"]) == sorted(n.node_id for n in nodes)
    assert first["lost"] and not second["lost"] and second["rows"] >= 1
    (added,) = [n for n in cluster.worker_nodes if n not in nodes]
    assert len(set(second["rank_nodes"])) == 2 and added.node_id in second["rank_nodes"]
    assert executor["replicas_replaced"] >= 1
    assert compared(out) == local_rows(tmp_path, tiny_folder, data)
