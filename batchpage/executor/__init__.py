"""Where a job generates: `executor=local` (one LLM in the job's process) or `executor=ray`
(a ReplicaPool of engine replicas on Ray, behind LLM's generate() contract, so the job loop,
the output writer and resume are the same under both).

    executor_factory(cfg)   None for local; for ray a ReplicaPool factory (Ray checked first)
    windows.py      the prefix order cut into contiguous windows
    work_queue.py   windows waiting, running, done; every row delivered once
    replica.py      the Ray actor's body: one LLM, rows streamed back as they finish
    ray_cluster.py  ray.init: a local instance sized to this machine, or join a cluster
    ray_executor.py ReplicaPool: dispatch, collect, requeue a dead replica's rows
    figures.py      a call's figures across replicas, and each replica's own
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from batchpage.executor.config import ExecutorConfig


def executor_factory(cfg: ExecutorConfig) -> Callable[..., Any] | None:
    """What makes the job's LLM: None for the local executor (the job's default, LLM); for ray
    a factory(model, **engine) of ReplicaPools. ValueError, with the install command, when Ray
    is missing, or naming the address when executor.address does not answer: checked here,
    before anything loads."""
    if cfg.kind == "local":
        return None
    from batchpage.executor.ray_cluster import check_answers, check_installed

    check_installed()
    if cfg.address:
        check_answers(cfg.address, cfg.connect_timeout_s)
    from batchpage.executor.ray_executor import ReplicaPool

    return functools.partial(ReplicaPool, executor=cfg)


__all__ = ["executor_factory"]
