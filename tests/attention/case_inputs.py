"""A kernel test case (batchpage.kernels.testing.PagedCase) as an attention backend's inputs: the
engine step's metadata and a two-layer pool; a step of mixed shapes for the window tests."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.testing import PagedCase, hide_outside_windows


def case_metadata(case: PagedCase) -> AttentionMetadata:
    """The case as one engine step's metadata."""
    return AttentionMetadata(
        slot_mapping=case.slot_mapping,
        query_start_loc=case.cu_seqlens_q,
        seq_lens=case.seq_lens,
        block_tables=case.block_table,
        block_size=case.k_cache.shape[1],
        query_lens_cpu=case.query_lens,
        seq_lens_cpu=tuple(case.seq_lens.tolist()),
    )


def two_layer_pool(case: PagedCase) -> KVCache:
    """A fresh pool whose layer 1 holds the case's K/V and whose layer 0, a bystander that the
    backend must leave untouched, holds zeros. Zeros, not the case's NaN fill, outside the
    contexts too: the torch backend's SDPA multiplies masked-off values by 0."""
    k, v = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
    return KVCache(k=[torch.zeros_like(k), k], v=[torch.zeros_like(v), v])


def mixed_step_lens(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of a step that holds every shape a window meets: five decodes
    sharing two prefix blocks (a cascade without a window), a lone-token decode, a whole prompt,
    and a chunk after the shared prefix."""
    bs = block_size
    seq_lens = [3 * bs + 5, 2 * bs + 7, 5 * bs, 2 * bs + 1, 4 * bs + 3, 1, bs + 3, 4 * bs + 2]
    query_lens = [1, 1, 1, 1, 1, 1, bs + 3, 5]
    return seq_lens, query_lens


def hidden_pool(case: PagedCase, window: int | None) -> KVCache:
    """two_layer_pool, with NaN in layer 1's blocks that lie wholly before every window that
    covers them: a backend that gathers one of them, even masked off, returns NaN."""
    if window is None:
        return two_layer_pool(case)
    clean = replace(case, k_cache=case.k_cache.nan_to_num(), v_cache=case.v_cache.nan_to_num())
    hidden = hide_outside_windows(clean, window, whole_blocks=True)
    zeros = torch.zeros_like(hidden.k_cache)
    return KVCache(k=[zeros, hidden.k_cache], v=[zeros.clone(), hidden.v_cache])
