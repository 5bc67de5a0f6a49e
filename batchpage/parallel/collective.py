"""The collectives a tensor-parallel group needs, behind one interface: `Collective` is a single
rank's (each the identity), `GroupCollective` a torch.distributed process group's (gloo on
CPUs, NCCL on CUDA). A model is bound to one of them once (`CausalLM.bind`); every rank of a
group must then run the same forwards, so that each collective is entered by all of them in
the same order.

Groups are process-group objects an engine owns (`open_group`), not torch.distributed's
default group: several engines, each with its own group, can live in one process one after the
other, and a user's own default group is left alone.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

# A collective waits this long for a peer that is alive but silent; a peer that died fails
# the collective at once (its sockets close).
TIMEOUT = datetime.timedelta(minutes=30)


class Collective:
    """One rank: nothing to combine."""

    world = 1

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a row-parallel linear's partial outputs)."""
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, world * C]
        """Every rank's x side by side, in rank order (vocabulary-parallel logits)."""
        return x


class GroupCollective(Collective):
    def __init__(self, group: dist.ProcessGroup, world: int) -> None:
        self.group = group
        self.world = world

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


def open_group(
    store: dist.Store, rank: int, world: int, device: torch.device
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the forward's group on `device`, a gloo group for host messages): the same group on a
    CPU, NCCL beside gloo on CUDA."""
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, TIMEOUT)
    if device.type != "cuda":
        return control, control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    forward = dist.ProcessGroupNCCL(dist.PrefixStore("forward", store), rank, world, options)
    return forward, control


def broadcast_object(group: dist.ProcessGroup, obj: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank (pickled; tensors must be on the CPU): its length, then
    its bytes, in two broadcasts. Rank 0 gets the message's size in bytes back."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    size = torch.zeros(1, dtype=torch.int64)
    payload = b""
    if rank == 0:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size[0] = len(payload)
    group.broadcast([size], options).wait()
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if rank == 0
        else torch.empty(int(size[0]), dtype=torch.uint8)
    )
    group.broadcast([data], options).wait()
    return len(payload) if rank == 0 else pickle.loads(data.numpy().tobytes())
