"""The torch paged backend against dense attention over contiguous K/V."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import plan_parts
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.cache.kv_cache import KVCache


def dense_reference(q, k, v, n_new, scale):
    """q [n, H, d] at the last n positions of k/v [L, kvh, d]; plain softmax attention."""
    seq_len, kvh, _ = k.shape
    group = q.shape[1] // kvh
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    pos = torch.arange(seq_len - n_new, seq_len)
    scores = scores.masked_fill(
        torch.arange(seq_len)[None, None, :] > pos[None, :, None], -math.inf
    )
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize(
    "query_lens", [(1, 1, 1), (5, 1, 9, 1), (17,), (1,) * 24], ids=["3d", "mixed", "pf", "24d"]
)
def test_paged_matches_dense(block_size, heads, query_lens):
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 8, 2048
    kv = KVCache.allocate(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    perm = torch.randperm(num_blocks).tolist()  # shuffled, non-contiguous tables
    # Context lengths spread from a few tokens to ~40 blocks: decode rows fall into several
    # length groups.
    cached = [int(torch.randint(0, 40 * block_size, ()).item() ** 0.5 * 6) for _ in query_lens]
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    tables, full_k, full_v, slots = [], [], [], []
    for c, length in zip(cached, seq_lens, strict=True):
        nb = -(-length // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(length, num_kv_heads, head_dim)
        v = torch.randn(length, num_kv_heads, head_dim)
        full_k.append(k)
        full_v.append(v)
        for pos in range(length):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < c:  # the cached prefix is already in the pool
                kv.k[0].view(-1, num_kv_heads, head_dim)[slot] = k[pos]
                kv.v[0].view(-1, num_kv_heads, head_dim)[slot] = v[pos]
            else:
                slots.append(slot)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        block_size=block_size,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached, strict=True)])
    scale = head_dim**-0.5
    out = TorchPagedAttention().plan(meta)(0, q, new_k, new_v, kv, meta, scale)
    for b, n in enumerate(query_lens):
        s = qsl[b].item()
        ref = dense_reference(q[s : s + n], full_k[b], full_v[b], n, scale)
        torch.testing.assert_close(out[s : s + n], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("shared_tokens", [0, 5, 64])
def test_decode_over_shared_prefix_blocks(block_size: int, shared_tokens: int) -> None:
    """Decodes whose tables start with the same blocks (a cached system prompt): the cascade
    path reads them once, and must match dense attention over each full context."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 8, 512
    kv = KVCache.allocate(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    flat_k = kv.k[0].view(-1, num_kv_heads, head_dim)
    flat_v = kv.v[0].view(-1, num_kv_heads, head_dim)
    free = torch.randperm(num_blocks).tolist()
    shared_blocks = [free.pop() for _ in range(shared_tokens // block_size)]
    shared = len(shared_blocks) * block_size
    shared_k = torch.randn(shared, num_kv_heads, head_dim)
    shared_v = torch.randn(shared, num_kv_heads, head_dim)
    for pos in range(shared):
        slot = shared_blocks[pos // block_size] * block_size + pos % block_size
        flat_k[slot], flat_v[slot] = shared_k[pos], shared_v[pos]
    seqs = 10
    own_lens = [int(x) for x in torch.randint(1, 3 * block_size + 2, (seqs,))]
    tables, full_k, full_v, slots = [], [], [], []
    for own in own_lens:
        length = shared + own
        table = shared_blocks + [
            free.pop() for _ in range(-(-length // block_size) - len(shared_blocks))
        ]
        k = torch.cat([shared_k, torch.randn(own, num_kv_heads, head_dim)])
        v = torch.cat([shared_v, torch.randn(own, num_kv_heads, head_dim)])
        for pos in range(shared, length):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < length - 1:
                flat_k[slot], flat_v[slot] = k[pos], v[pos]
            else:
                slots.append(slot)  # the decode token's K/V arrives with the step
        tables.append(table)
        full_k.append(k)
        full_v.append(v)
    width = max(len(t) for t in tables)
    seq_lens = [shared + own for own in own_lens]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
        query_lens_cpu=(1,) * seqs,
        seq_lens_cpu=tuple(seq_lens),
    )
    q = torch.randn(seqs, num_heads, head_dim)
    new_k = torch.stack([k[-1] for k in full_k])
    new_v = torch.stack([v[-1] for v in full_v])
    out = TorchPagedAttention().plan(meta)(0, q, new_k, new_v, kv, meta, head_dim**-0.5)
    cascades = [p for p in plan_parts(meta) if p.prefix_blocks is not None]
    assert bool(cascades) == bool(shared_blocks)  # the path under test really ran
    for b in range(seqs):
        ref = dense_reference(q[b : b + 1], full_k[b], full_v[b], 1, head_dim**-0.5)
        torch.testing.assert_close(out[b : b + 1], ref, atol=1e-5, rtol=1e-5)


def test_step_refuses_another_steps_metadata() -> None:
    """A plan holds one step's rows and blocks; used with another step's metadata it would attend
    the wrong rows silently."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3], dtype=torch.long),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([4], dtype=torch.int32),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        block_size=4,
        query_lens_cpu=(1,),
        seq_lens_cpu=(4,),
    )
    kv = KVCache.allocate(1, 2, 4, 1, 8, torch.float32, "cpu")
    step = TorchPagedAttention().plan(meta)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    assert step(0, q, k, k, kv, meta, 0.3).shape == q.shape
    with pytest.raises(ValueError, match="call backend.plan\\(meta\\) for each step"):
        step(0, q, k, k, kv, dataclasses.replace(meta), 0.3)
