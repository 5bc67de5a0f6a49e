"""The shared-memory all-reduce of CPU ranks on one host (batchpage/ops/shm_collective.py),
against the sum of every rank's tensor computed in one process: the same bits on every rank,
in rank order; tensors larger than a slot through gloo; a rank that ends mid-collective named
by the rank waiting for it."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpage.ops.shm_collective import (
    SLOT_BYTES,
    SharedMemoryCollective,
    shared_memory_collective,
)

# (rows, columns, dtype): a decode step's partial sums, one past a slot's bytes (gloo's path).
SHAPES = [(1, 8, torch.float32), (8, 2048, torch.bfloat16), (64, 2048, torch.float32),
          (SLOT_BYTES // 4 // 512 + 1, 512, torch.float32), (3, 5, torch.bfloat16)]  # fmt: skip
ROUNDS = 40


def _tensor(rank: int, step: int) -> torch.Tensor:
    rows, cols, dtype = SHAPES[step % len(SHAPES)]
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, cols, generator=gen).to(dtype)


def _rank(
    rank: int, world: int, port: int, die_at: int | None, out, elsewhere: bool = False
) -> None:
    """One rank: ROUNDS all-reduces. `elsewhere`: rank 1 says it is on another host."""
    torch.set_num_threads(1)
    if elsewhere and rank == 1:
        import batchpage.ops.shm_collective as shm

        shm._host_id = lambda: "another host"
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    comm = shared_memory_collective(store, group, rank, world, torch.device("cpu"))
    results = []
    try:
        assert isinstance(comm, SharedMemoryCollective) != elsewhere
        for step in range(ROUNDS):
            if rank == 1 and step == die_at:
                os._exit(3)
            x = _tensor(rank, step)
            assert comm.all_reduce_(x) is x
            results.append(x.float().numpy())  # exact for bf16; numpy: no fd to pass
    except Exception as e:  # reported to the test, which asserts on it
        out.put((rank, f"{type(e).__name__}: {e}"))
        return
    out.put((rank, results))


def _run(world: int, die_at: int | None = None, elsewhere: bool = False) -> dict[int, object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, die_at, out, elsewhere))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    alive = world - (die_at is not None)
    got = dict(out.get(timeout=120) for _ in range(alive))
    for p in procs:
        p.join(timeout=30)
    return got


@pytest.mark.parametrize(("world", "elsewhere"), [(2, False), (3, False), (3, True)])
def test_every_rank_gets_the_sum_in_rank_order(world: int, elsewhere: bool) -> None:
    """elsewhere: one rank on another host declines the segment, and every rank then sums
    through gloo (its own order: close, not the same bits)."""
    got = _run(world, elsewhere=elsewhere)
    for step in range(ROUNDS):
        parts = [_tensor(r, step) for r in range(world)]
        want = parts[0].clone()
        for part in parts[1:]:
            want.add_(part)
        fits = want.numel() * want.element_size() <= SLOT_BYTES and not elsewhere
        for rank in range(world):
            ours = torch.from_numpy(got[rank][step]).to(want.dtype)  # type: ignore[index]
            if fits:  # the same adds in the same order: the same bits
                assert torch.equal(ours, want), (rank, step)
            else:  # gloo's own order: within two roundings of the exact sum
                exact = sum(part.double() for part in parts)
                bf16 = want.dtype == torch.bfloat16
                tol = {"rtol": 2**-7, "atol": 2**-6} if bf16 else {"rtol": 1e-5, "atol": 1e-5}
                torch.testing.assert_close(ours.double(), exact, **tol)
            assert (got[rank][step] == got[0][step]).all()  # type: ignore[index]


def test_a_rank_that_ends_is_named_by_the_rank_waiting_for_it() -> None:
    start = time.monotonic()
    got = _run(2, die_at=4)  # a step that fits a slot
    assert got[0] == "RuntimeError: tensor-parallel rank 1 ended during an all-reduce"
    assert time.monotonic() - start < 60
