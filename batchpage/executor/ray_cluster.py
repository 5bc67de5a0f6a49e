"""Reaching Ray: check that it is installed, then join a cluster or start a local instance.

executor.address empty starts a private local instance sized to this machine (its CPUs, its
GPUs), with no dashboard, even where a cluster is running on the machine (`ray start` ran here,
or RAY_ADDRESS is set): Ray's `address="local"`. `auto` joins the cluster this node belongs to,
`host:port` joins that one (Ray Client, `ray://`, is refused by ExecutorConfig); a cluster that
is joined is used as it is sized (no resource arguments: Ray refuses them when connecting). A
process that already called ray.init (a script, a test) is used as it is and left connected
afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchpage.distributed.ray_ranks import ray_init
from batchpage.executor.config import ExecutorConfig

INSTALL_HINT = "pip install 'batchpage[ray]'"


def check_installed() -> None:
    """ValueError with the install command when Ray is missing (found without importing it)."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(f"executor=ray needs Ray, which is not installed: {INSTALL_HINT}")


@dataclass(frozen=True)
class Connection:
    address: str  # what the job ran on: "local", "auto" or host:port
    owned: bool  # this job called ray.init, so it shuts Ray down at the end


def connect(cfg: ExecutorConfig) -> Connection:
    """ray.init as executor.address says; ValueError naming the fix when it cannot."""
    import ray

    if ray.is_initialized():
        check_room(cfg, "the running Ray instance")
        return Connection("existing", owned=False)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    if cfg.address:
        check_answers(cfg.address, cfg.connect_timeout_s)
        try:
            joined = _init_within(cfg.connect_timeout_s, address=cfg.address, **quiet)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"executor.address={cfg.address} cannot be joined ({e}); start the cluster with "
                "`ray start --head` (or leave executor.address empty for a local instance)"
            ) from None
        if not joined:
            raise ValueError(
                f"executor.address={cfg.address} ({cluster_address(cfg.address)}) accepts "
                f"connections but no Ray head answered within {cfg.connect_timeout_s:g} s: check "
                "that it is the head's GCS port (6379 unless `ray start --port` said otherwise) "
                "and that the head is not stuck (`ray status` on it), or raise "
                "executor.connect_timeout_s"
            )
        check_room(cfg, f"executor.address={cfg.address}")
        return Connection(cfg.address, owned=True)
    cpus, gpus = local_resources()
    refuse_unless_room(cfg, cpus, gpus, "this machine", "join a cluster with executor.address=auto")
    ray_init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False, **quiet)
    return Connection("local", owned=True)


def check_room(cfg: ExecutorConfig, where: str) -> None:
    """ValueError naming the fix when the joined cluster's resources, all of its nodes
    together, cannot hold the replicas at once: Ray would keep the ones it cannot place waiting
    for room without end, and the job with them."""
    import ray

    total = ray.cluster_resources()
    more = "add nodes (an autoscaling cluster: with its nodes up before the job starts)"
    refuse_unless_room(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), where, more)


def refuse_unless_room(
    cfg: ExecutorConfig, cpus: float, gpus: float, where: str, more: str
) -> None:
    """ValueError when `where`'s `cpus` and `gpus` cannot hold every replica at once; `more`:
    the fix beyond asking for less."""
    need_cpus = cfg.num_replicas * cfg.cpus_per_replica
    need_gpus = cfg.num_replicas * cfg.gpus_per_replica
    if need_cpus > cpus or need_gpus > gpus:
        raise ValueError(
            f"executor.num_replicas={cfg.num_replicas} replicas need {need_cpus} CPUs and "
            f"{need_gpus:g} GPUs, {where} has {cpus:g} and {gpus:g}: lower "
            f"executor.num_replicas, executor.cpus_per_replica or executor.gpus_per_replica, or "
            f"{more}"
        )


def _init_within(timeout_s: float, **kwargs: Any) -> bool:
    """ray.init(**kwargs); False when it has not returned within timeout_s. Joining a port that
    accepts connections but where no Ray head answers (a stuck head, another service) retries
    without a limit, so it runs in a daemon thread, left behind when it does not return (the
    caller stops). Its errors are raised here."""
    import ray

    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ray.init(**kwargs)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
            outcome.append(e)

    # From a thread, Ray warns that it leaves the process's SIGTERM handler alone: what the job
    # wants (its own handler saves buffered rows), so the warning is not shown.
    worker_log = logging.getLogger("ray._private.worker")
    level = worker_log.level
    worker_log.setLevel(logging.ERROR)
    try:
        thread = threading.Thread(target=init, name="ray-init", daemon=True)
        thread.start()
        thread.join(timeout_s)
    finally:
        worker_log.setLevel(level)
    if not outcome:
        return False
    if outcome[0] is not None:
        raise outcome[0]
    return True


def cluster_address(address: str) -> str | None:
    """The host:port ray.init(address) will dial, found as Ray finds it: RAY_ADDRESS wins; for
    "auto", the address the newest cluster started on this machine left in Ray's temp folder
    (None when there is none: ray.init then fails at once, naming it)."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    if address != "auto":
        return address
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        return current.read_text().strip() or None
    except OSError:
        return None


def check_answers(address: str, timeout_s: float) -> None:
    """ValueError naming the address and what to check when nothing accepts a connection at
    it within timeout_s: ray.init would otherwise wait on a dead cluster without a limit."""
    target = cluster_address(address)
    if target is None:
        return
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except ValueError:
        problem = "it is not host:port"
    except OSError as e:
        problem = f"nothing answered within {timeout_s:g} s: {e.strerror or e}"
    raise ValueError(
        f"executor.address={address} ({target}) cannot be reached, {problem}; check that the "
        "cluster is up (`ray status` on its head node) and that this machine reaches that host "
        "and port (raise executor.connect_timeout_s for a slow network), or leave "
        "executor.address empty for a local instance"
    )


def local_resources() -> tuple[int, int]:
    """CPUs this process may run on and the GPUs torch sees."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cpus or 1, torch.cuda.device_count()
