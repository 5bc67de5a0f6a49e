"""The KV pool's tensors: one K and one V tensor per layer, indexed by block id.

Layout of each tensor: [num_blocks, block_size, num_kv_heads, head_dim]. Block ids are handed out
by BlockPool (block_pool.py); this module only owns the memory and knows how big a block is.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from batchpage.host_memory import advise_huge_pages


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """K and V of every layer for block_size tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor none of whose pages is touched yet: a private anonymous mapping,
    which the kernel fills with zero pages as each is first written. A pool of gigabytes written
    with zeros at setup faults every page in before the first step, though a run may use few of
    its blocks; this way each page is faulted in when a block on it is first written. Huge pages
    are requested before any write (see host_memory.py)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds a reference to the mapping, which is unmapped when the tensor is freed.
    t = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    advise_huge_pages(t)
    return t


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    v: list[torch.Tensor]  # per layer: [num_blocks, block_size, num_kv_heads, head_dim]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def pool() -> torch.Tensor:
            # One allocation per layer keeps each layer's pool contiguous for the kernels.
            if torch.device(device).type == "cpu":
                return _untouched_zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=device)

        k = [pool() for _ in range(num_layers)]
        v = [pool() for _ in range(num_layers)]
        return cls(k=k, v=v)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: duplicate one block's K/V in every layer."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def swap_out(self, blocks: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of the given blocks' K/V on the CPU, per layer: [len(blocks), bs, kvh, hd]."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        return [k[idx].cpu() for k in self.k], [v[idx].cpu() for v in self.v]

    def swap_in(
        self, blocks: list[int], saved: tuple[list[torch.Tensor], list[torch.Tensor]]
    ) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for k, v, sk, sv in zip(self.k, self.v, saved[0], saved[1], strict=True):
            k[idx] = sk.to(k.device)
            v[idx] = sv.to(v.device)
