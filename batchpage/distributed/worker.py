"""A tensor-parallel rank other than 0: `load_share` loads its share of the model, `run_steps`
joins the group, sets up the same runner as the driver's engine and runs every step the driver
broadcasts until the driver sends None.

Two hosts call them (distributed_executor_backend): `python -m batchpage.distributed.worker`, a
process started by the driver (process_ranks.py) with its WorkerSpec pickled on stdin, which
tells the driver on stdout ("loaded", or one line of error; its logs go to stderr, which it
shares with the driver); and a Ray actor (ray_ranks.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from batchpage.engine.config import EngineConfig
from batchpage.engine.model_runner import ForwardStep, build_model_runner
from batchpage.engine.plan import EnginePlan
from batchpage.model.loader import ModelSource, load_model
from batchpage.model.shard import TensorShard
from batchpage.ops.collective import broadcast_object, open_group
from batchpage.ops.shm_collective import shared_memory_collective

LOADED = "loaded"


@dataclass(frozen=True)
class WorkerSpec:
    source: ModelSource
    cfg: EngineConfig
    plan: EnginePlan  # the driver's: its block count is every rank's
    rank: int
    world: int
    store_host: str  # where the driver's TCPStore listens
    store_port: int
    threads: int  # torch intra-op threads (CPU)
    device: torch.device  # this rank's, as its process sees the host's devices


def rank_device(plan: EnginePlan, rank: int) -> torch.device:
    """Rank r runs on CUDA device (the driver's + r); on a CPU, every rank on the host."""
    if plan.device.type != "cuda":
        return plan.device
    return torch.device("cuda", (plan.device.index or 0) + rank)


def to_device(step: ForwardStep, device: torch.device) -> ForwardStep:
    """The step with its tensors on `device` (the host, for the message)."""
    meta = step.meta
    meta = replace(
        meta,
        slot_mapping=meta.slot_mapping.to(device),
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens=meta.seq_lens.to(device),
        block_tables=meta.block_tables.to(device),
        key_end=None if meta.key_end is None else meta.key_end.to(device),
    )
    rows = [None if t is None else t.to(device) for t in (step.prompt_rows, step.pool_rows)]
    return step._replace(
        input_ids=step.input_ids.to(device),
        positions=step.positions.to(device),
        meta=meta,
        logits_indices=step.logits_indices.to(device),
        prompt_rows=rows[0],
        pool_rows=rows[1],
    )


def load_share(spec: WorkerSpec) -> torch.nn.Module:
    """This rank's share of the model, on its device (the process's torch threads set)."""
    torch.set_num_threads(spec.threads)
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    return load_model(
        spec.source,
        spec.plan.dtype,
        spec.device,
        max_positions=spec.plan.max_model_len,
        int8_activations=spec.cfg.int8_activations,
        shard=TensorShard(spec.rank, spec.world),
    ).model


def run_steps(spec: WorkerSpec, model: torch.nn.Module, host: str) -> None:
    """Join the group (its connections from `host`, this rank's address) and run the driver's
    steps until it sends None. RuntimeError when the group breaks (the driver closed it, or a
    rank died)."""
    plan = replace(spec.plan, device=spec.device)
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.world, is_master=False)
    forward, control = open_group(store, spec.rank, spec.world, spec.device, host)
    comm = shared_memory_collective(store, forward, spec.rank, spec.world, spec.device)
    runner = build_model_runner(model, spec.cfg, plan, comm=comm).runner
    while (step := broadcast_object(control, None, spec.rank)) is not None:
        runner.run(to_device(step, spec.device))


def serve(spec: WorkerSpec) -> None:
    """The worker process's life: load, say so on stdout, run steps."""
    try:
        model = load_share(spec)
    except Exception as e:  # anything loading raises: one line for the driver to report
        print(" ".join(f"{type(e).__name__}: {e}".split())[:2000], flush=True)
        raise SystemExit(1) from None
    print(LOADED, flush=True)
    driver = os.getppid()
    try:
        run_steps(spec, model, spec.store_host)  # the driver's host is this one
    except Exception as e:  # noqa: BLE001 (whatever broke, with the driver gone nothing is owed)
        if not _driver_gone(driver):
            if not isinstance(e, RuntimeError):
                raise
            # The group broke under a live driver (a rank died): the driver names it.
            print(f"batchpage: rank {spec.rank} stopped: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        # The driver died (its sockets closed under a collective or a wait): nothing is left
        # to serve, and a traceback from each rank would bury the driver's own message.
        print(f"batchpage: rank {spec.rank}: the driver (pid {driver}) is gone", file=sys.stderr)
        raise SystemExit(1) from None


def _driver_gone(driver: int, grace_s: float = 1.0) -> bool:
    """Whether the driver process died. A dying process closes its sockets before its children
    are handed to a new parent, so a broken group may be seen a moment before getppid changes."""
    deadline = time.monotonic() + grace_s
    while os.getppid() == driver:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main() -> None:
    # Ctrl-C in a terminal reaches every process of the foreground group: the driver alone acts
    # on it (it tells its ranks to return, or ends them), so no rank stops on its own first.
    # SIGTERM keeps its default action: it is how the driver ends a rank inside a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Run as __main__, this file's classes are not the ones the spec was pickled with: take
    # them from the module under its own name.
    from batchpage.distributed import worker

    spec = pickle.load(sys.stdin.buffer)
    assert isinstance(spec, worker.WorkerSpec)
    worker.serve(spec)


if __name__ == "__main__":
    main()
