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
import io
import math
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
    store: dist.Store, rank: int, world: int, device: torch.device, host: str
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(the forward's group on `device`, a gloo group for host messages): the same group on a
    CPU, NCCL beside gloo on CUDA. `host`: the address this rank's gloo connections use (the
    name the host resolves to may be a loopback address other nodes cannot reach)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = TIMEOUT
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, options)
    if device.type != "cuda":
        return control, control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = TIMEOUT
    forward = dist.ProcessGroupNCCL(dist.PrefixStore("forward", store), rank, world, options)
    return forward, control


def broadcast_object(group: dist.ProcessGroup, obj: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank; tensors in it must be on the CPU. Pickling a tensor costs
    far more than its bytes, so the tensors travel apart: the pickle holds a reference to each
    (its offset, dtype and shape), and one byte buffer holds the pickle then every tensor's
    bytes, 8-byte aligned. Two broadcasts: the buffer's sizes, then the buffer. Rank 0 gets
    the message's size in bytes back."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    sizes = torch.zeros(2, dtype=torch.int64)  # pickle bytes, tensor bytes
    if rank == 0:
        tensors: list[torch.Tensor] = []
        head = io.BytesIO()
        _TensorPickler(head, tensors).dump(obj)
        parts = [torch.frombuffer(bytearray(head.getbuffer()), dtype=torch.uint8), *tensors]
        buffer = torch.cat(parts) if len(parts) > 1 else parts[0]
        sizes[0], sizes[1] = head.tell(), buffer.numel() - head.tell()
    group.broadcast([sizes], options).wait()
    if rank != 0:
        buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    group.broadcast([buffer], options).wait()
    if rank == 0:
        return buffer.numel()
    head_bytes = int(sizes[0])
    stream = io.BytesIO(buffer[:head_bytes].numpy().tobytes())
    return _TensorUnpickler(stream, buffer, head_bytes).load()


class _TensorPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors  # each as 8-byte-aligned uint8, after the pickle
        self.offset = 0

    def persistent_id(self, obj: Any) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        raw = obj.detach().contiguous().view(-1).view(torch.uint8)
        pad = -raw.numel() % 8
        self.tensors.append(torch.cat([raw, raw.new_zeros(pad)]) if pad else raw)
        ref = (self.offset, obj.dtype, tuple(obj.shape))
        self.offset += raw.numel() + pad
        return ref


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffer: torch.Tensor, head_bytes: int) -> None:
        super().__init__(file)
        # Offsets count from the first tensor, which the pickle's length may leave unaligned.
        self.data = buffer[head_bytes:].clone()

    def persistent_load(self, pid: tuple[int, torch.dtype, tuple[int, ...]]) -> torch.Tensor:
        offset, dtype, shape = pid
        count = math.prod(shape) * dtype.itemsize
        return self.data[offset : offset + count].view(dtype).view(shape)
