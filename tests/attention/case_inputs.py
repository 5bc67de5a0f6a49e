"""A kernel test case (batchpage.kernels.testing.PagedCase) as an attention backend's inputs: the
engine step's metadata and a two-layer pool."""

from __future__ import annotations

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.testing import PagedCase


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
