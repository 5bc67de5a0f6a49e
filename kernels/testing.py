"""Random paged-attention inputs for the kernel tests and jobs/bench/gpu.py.

A case is a batch of sequences whose contexts live in a shuffled, non-contiguous set of pool
blocks. Every pool slot a sequence does not own holds NaN (unless the pool is lazy, see below), so
a kernel that reads one slot outside a context, or a masked-off lane, turns its output into NaN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class PagedCase:
    q: torch.Tensor  # [total_q, num_heads, head_dim]: the new tokens' queries
    k_new: torch.Tensor  # [total_q, num_kv_heads, head_dim]: the new tokens' keys
    v_new: torch.Tensor  # [total_q, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # int32 [B, max_blocks], padded with 0
    seq_lens: torch.Tensor  # int32 [B]: context length, new tokens included
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    slot_mapping: torch.Tensor  # int64 [total_q]: where the new tokens' K/V belong
    query_lens: tuple[int, ...]

    @property
    def max_seqlen_q(self) -> int:
        return max(self.query_lens, default=0)


def make_paged_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shared_blocks: int = 0,
    num_blocks: int | None = None,
    lazy_pool: bool = False,
    write_new: bool = True,
    seed: int = 0,
) -> PagedCase:
    """seq_lens[b] context tokens, the last query_lens[b] of them new.

    shared_blocks: that many leading blocks are the same physical blocks (same K/V) in every
    sequence whose cached prefix covers them, as prefix caching shares them.
    lazy_pool: allocate the pool with torch.empty and never touch the blocks nobody owns, and put
    the owned blocks at the top of the pool: with num_blocks large, block_id * block stride passes
    2**31 elements while only a few pages of memory are ever committed.
    write_new: store the new tokens' K/V in the pool too (attention tests); False leaves their
    slots as they were (NaN), for tests that write them first.
    """
    assert len(seq_lens) == len(query_lens)
    assert all(0 < n <= s for s, n in zip(seq_lens, query_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    shareable = [(s - n) // block_size for s, n in zip(seq_lens, query_lens, strict=True)]
    shared = shared_blocks
    sharers = [shared > 0 and c >= shared for c in shareable]
    owned = [nb - (shared if sh else 0) for nb, sh in zip(blocks_per_seq, sharers, strict=True)]
    needed = shared + sum(owned)
    if num_blocks is None:
        num_blocks = 2 * needed + 3  # spare blocks, so the tables are not a permutation of all
    assert num_blocks >= needed, f"{num_blocks} blocks < {needed} needed"

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if lazy_pool:
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
        top = min(num_blocks, 2 * needed)
        ids = (num_blocks - top + torch.randperm(top, generator=gen))[:needed].tolist()
    else:
        k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
        ids = torch.randperm(num_blocks, generator=gen)[:needed].tolist()
    prefix_ids, ids = ids[:shared], ids[shared:]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype=dtype, device=device)

    # The shared prefix's K/V, identical in every sequence that uses it.
    prefix_k = rand(shared * block_size, num_kv_heads, head_dim)
    prefix_v = rand(shared * block_size, num_kv_heads, head_dim)
    tables: list[list[int]] = []
    k_new, v_new, slots = [], [], []
    for seq_len, q_len, own, sharer in zip(seq_lens, query_lens, owned, sharers, strict=True):
        table = (prefix_ids if sharer else []) + ids[:own]
        ids = ids[own:]
        tables.append(table)
        k = rand(seq_len, num_kv_heads, head_dim)
        v = rand(seq_len, num_kv_heads, head_dim)
        if sharer:
            k[: shared * block_size] = prefix_k
            v[: shared * block_size] = prefix_v
        blk = torch.tensor(table, device=device).repeat_interleave(block_size)[:seq_len]
        off = torch.arange(seq_len, device=device) % block_size
        cached = seq_len - q_len
        stop = seq_len if write_new else cached
        k_cache[blk[:stop], off[:stop]] = k[:stop]
        v_cache[blk[:stop], off[:stop]] = v[:stop]
        k_new.append(k[cached:])
        v_new.append(v[cached:])
        slots.append(blk[cached:] * block_size + off[cached:])

    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    total_q = sum(query_lens)
    return PagedCase(
        q=rand(total_q, num_heads, head_dim),
        k_new=torch.cat(k_new),
        v_new=torch.cat(v_new),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        slot_mapping=torch.cat(slots).to(torch.int64),
        query_lens=tuple(query_lens),
    )


def interpreter_skip_reason() -> str | None:
    """Why the kernels cannot run in this process, or None. Importing a Triton kernel module
    turns Triton's interpreter on when there is no CUDA (common.py); this only fails if
    TRITON_INTERPRET was set to something false beforehand."""
    if torch.cuda.is_available():
        return None
    from batchpage.kernels import paged_decode_attention

    if type(paged_decode_attention._decode_single_kernel).__name__ == "InterpretedFunction":
        return None
    return (
        "no CUDA and batchpage.kernels.common was imported with TRITON_INTERPRET="
        f"{os.environ.get('TRITON_INTERPRET')!r}: run with TRITON_INTERPRET=1 to test on CPU"
    )


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances against the float32 reference: half types round q, k, v, the
    softmax weights (cast to the value dtype for the P @ V product) and the output."""
    if dtype == torch.float32:
        return {"atol": 1e-4, "rtol": 1e-4}
    return {"atol": 4e-3, "rtol": 4e-3} if dtype == torch.float16 else {"atol": 3e-2, "rtol": 3e-2}


def hide_outside_windows(case: PagedCase, window: int, whole_blocks: bool = False) -> PagedCase:
    """The case with NaN in every pool slot that no query row's sliding window covers (row p
    sees p - window < k <= p), so a kernel that reads one of them, even masked off, returns NaN.

    A slot shared by several sequences (prefix blocks) stays when any of them sees it.
    whole_blocks: hide only blocks none of whose slots any window covers, for a backend that
    reads the window's first block whole and masks its leading slots."""
    block_size = case.k_cache.shape[1]
    seen = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool, device=case.k_cache.device)
    owned = torch.zeros_like(seen)
    for b, (seq_len, q_len) in enumerate(zip(case.seq_lens.tolist(), case.query_lens, strict=True)):
        first = max(0, seq_len - q_len - window + 1)  # the first row's window start
        blocks = case.block_table[b].long().repeat_interleave(block_size)[:seq_len]
        offs = torch.arange(seq_len, device=seen.device) % block_size
        owned[blocks, offs] = True
        seen[blocks[first:], offs[first:]] = True
    if whole_blocks:
        seen = seen.any(dim=1, keepdim=True).expand_as(seen)
    hide = owned & ~seen
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache[hide] = float("nan")
    v_cache[hide] = float("nan")
    return replace(case, k_cache=k_cache, v_cache=v_cache)
