"""The torch paged backend against dense attention over contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from batchpage.attention.metadata import AttentionMetadata
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
@pytest.mark.parametrize("query_lens", [(1, 1, 1), (5, 1, 9, 1), (17,)])
def test_paged_matches_dense(block_size, heads, query_lens):
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 8, 64
    kv = KVCache.allocate(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    perm = torch.randperm(num_blocks).tolist()  # shuffled, non-contiguous tables
    cached = [torch.randint(0, 2 * block_size + 3, ()).item() for _ in query_lens]
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
    out = TorchPagedAttention()(0, q, new_k, new_v, kv, meta, scale)
    for b, n in enumerate(query_lens):
        s = qsl[b].item()
        ref = dense_reference(q[s : s + n], full_k[b], full_v[b], n, scale)
        torch.testing.assert_close(out[s : s + n], ref, atol=1e-5, rtol=1e-5)
