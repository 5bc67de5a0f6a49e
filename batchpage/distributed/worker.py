"""A tensor-parallel worker: `python -m batchpage.distributed.worker`, started by the driver
(workers.py) with its WorkerSpec pickled on stdin.

It loads its rank's share of the model, tells the driver on stdout ("loaded", or one line of
error), joins the group, sets up the same runner as the driver's engine, and then runs every
step the driver broadcasts until the driver sends None. Its stdout carries only those lines;
logs go to stderr, which it shares with the driver.
"""

from __future__ import annotations

import os
import pickle
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
from batchpage.ops.collective import GroupCollective, broadcast_object, open_group

LOADED = "loaded"


@dataclass(frozen=True)
class WorkerSpec:
    source: ModelSource
    cfg: EngineConfig
    plan: EnginePlan  # the driver's: its block count is every rank's
    rank: int
    world: int
    store_port: int  # the driver's TCPStore, on this host
    threads: int  # torch intra-op threads (CPU)


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


def serve(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    device = rank_device(spec.plan, spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg, plan = spec.cfg, replace(spec.plan, device=device)
    try:
        loaded = load_model(
            spec.source,
            plan.dtype,
            device,
            max_positions=plan.max_model_len,
            quantized=cfg.quantized_weights is not False,
            int8_activations=cfg.int8_activations,
            shard=TensorShard(spec.rank, spec.world),
        )
    except Exception as e:  # anything loading raises: one line for the driver to report
        print(" ".join(f"{type(e).__name__}: {e}".split())[:2000], flush=True)
        raise SystemExit(1) from None
    print(LOADED, flush=True)
    driver = os.getppid()
    try:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world, is_master=False)
        forward, control = open_group(store, spec.rank, spec.world, device)
        runner = build_model_runner(
            loaded.model, cfg, plan, comm=GroupCollective(forward, spec.world)
        ).runner
        while True:
            try:
                step = broadcast_object(control, None, spec.rank)
            except RuntimeError:  # the group broke: the driver closed it, or it died
                if not _driver_gone(driver):
                    raise SystemExit(1) from None  # nothing left to serve; the driver reports
                raise
            if step is None:
                return
            runner.run(to_device(step, device))
    except Exception:  # noqa: BLE001 (whatever broke, with the driver gone nothing is owed)
        if not _driver_gone(driver):
            raise
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
    # Run as __main__, this file's classes are not the ones the spec was pickled with: take
    # them from the module under its own name.
    from batchpage.distributed import worker

    spec = pickle.load(sys.stdin.buffer)
    assert isinstance(spec, worker.WorkerSpec)
    worker.serve(spec)


if __name__ == "__main__":
    main()
