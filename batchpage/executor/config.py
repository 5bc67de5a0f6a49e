"""ExecutorConfig: where a job generates; the schema of Hydra's `executor` group.

It imports nothing of the job, so that the job's config can hold it and the executors can read
it without an import cycle."""

from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_KINDS = ("local", "ray")


@dataclass
class ExecutorConfig:
    """Where the job generates: `local` (one engine in this process) or `ray` (num_replicas
    engine replicas, each a Ray actor holding one LLM, fed contiguous windows of the job's prefix
    order through a work queue; the driver still writes every row). Nothing here changes the
    results, so it is not part of the job's fingerprint: a job may resume under another executor.
    """

    kind: str = "local"  # local | ray
    num_replicas: int = 2
    # What Ray reserves for each replica: its GPUs, and its CPUs (its torch threads). A replica
    # of engine.tensor_parallel_size=N ranks is a placement group of N bundles, each an equal
    # share of both (replica_bundles); its ranks may land on different nodes.
    gpus_per_replica: float = 0.0
    cpus_per_replica: int = 1
    # "": start a private local Ray instance sized to this machine (even where a cluster runs);
    # "auto" or "host:port": join that cluster as it is sized. Ray Client ("ray://") is
    # refused: the replicas stream rows back through actor methods, which it cannot carry.
    address: str = ""
    # Seconds to wait for executor.address to accept a connection before the job stops (exit 2).
    connect_timeout_s: float = 30.0
    # Rows per window handed to a replica. Cuts fall where neighbours share the least prefix.
    window_rows: int = 64
    # Windows queued on a replica at once: one running, the next ready, so it never waits.
    windows_per_replica: int = 2
    # Replicas started in place of lost ones (a killed process, a lost node), counted over the
    # job; past it the job finishes on the survivors.
    max_restarts: int = 8

    def __post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise ValueError(
                f"executor.kind={self.kind!r} is unknown; use executor=local or executor=ray"
            )
        for name in ("num_replicas", "cpus_per_replica", "window_rows", "windows_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"executor.{name}={getattr(self, name)} must be >= 1")
        if self.max_restarts < 0:
            raise ValueError(f"executor.max_restarts={self.max_restarts} must be >= 0")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"executor.connect_timeout_s={self.connect_timeout_s} must be > 0")
        if self.gpus_per_replica < 0:
            raise ValueError(f"executor.gpus_per_replica={self.gpus_per_replica} must be >= 0")
        if self.address.startswith("ray://"):
            raise ValueError(
                f"executor.address={self.address} is a Ray Client address, which cannot carry "
                "the rows replicas stream back: run the job on a node of the cluster with "
                "executor.address=auto (or the head's host:port)"
            )


def replica_bundles(cfg: ExecutorConfig, ranks: int) -> list[dict[str, float]]:
    """The placement-group bundles of one replica of `ranks` tensor-parallel ranks, one per rank:
    each an equal share of the replica's CPUs (whole ones: they are its torch threads) and
    GPUs (one each when split). ValueError naming the fix when they do not split so."""
    if cfg.cpus_per_replica % ranks:
        raise ValueError(
            f"executor.cpus_per_replica={cfg.cpus_per_replica} does not split over "
            f"engine.tensor_parallel_size={ranks} ranks (each takes whole CPUs for its threads): "
            f"use a multiple of {ranks}"
        )
    if ranks > 1 and cfg.gpus_per_replica not in (0, ranks):
        raise ValueError(
            f"executor.gpus_per_replica={cfg.gpus_per_replica:g} does not split over "
            f"engine.tensor_parallel_size={ranks} ranks: use {ranks} (one GPU per rank), or 0 "
            "on CPUs"
        )
    bundle = {"CPU": float(cfg.cpus_per_replica // ranks)}
    if cfg.gpus_per_replica:
        bundle["GPU"] = cfg.gpus_per_replica / ranks
    return [dict(bundle) for _ in range(ranks)]
