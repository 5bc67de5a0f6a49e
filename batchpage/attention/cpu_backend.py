"""The CPU attention backend: decode rows through the C++ paged-decode kernel, which reads the
pool in place (kernels/cpu_paged_decode.py); rows of a sequence with several new tokens (prefill,
a prefill chunk) through the torch implementation (torch_backend.py), whose cost there is the
attention itself, not the gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.torch_backend import _Part, attend_parts, plan_parts, write_kv
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode


@dataclass(frozen=True)
class _Plan:
    """A step's split, built at its first layer and reused by the others."""

    meta: AttentionMetadata
    all_decode: bool  # every sequence has one new token: rows and sequences coincide
    decode_rows: torch.Tensor  # int64 [Nd]: the one-token sequences' rows
    decode_tables: torch.Tensor  # int32 [Nd, max_blocks]
    decode_lens: torch.Tensor  # int32 [Nd]
    parts: list[_Part]  # everything else, for the torch path


def _plan(meta: AttentionMetadata) -> _Plan:
    if meta.is_decode_only:
        return _Plan(meta, True, torch.empty(0), meta.block_tables, meta.seq_lens, [])
    decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    index = torch.tensor(decode, dtype=torch.long)
    return _Plan(
        meta,
        False,
        meta.query_start_loc[:-1].long()[index],
        meta.block_tables[index].contiguous(),
        meta.seq_lens[index].contiguous(),
        plan_parts(meta, decode_rows=False),
    )


class CpuPagedAttention:
    """AttentionBackend for CPU tensors (see backend.py for the contract)."""

    def __init__(self, kernel: CpuPagedDecode) -> None:
        self.kernel = kernel
        self._plan: _Plan | None = None

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if self._plan is None or self._plan.meta is not meta:
            self._plan = _plan(meta)
        plan = self._plan
        q = q.to(k_cache.dtype).contiguous()
        if plan.all_decode:
            return self.kernel(q, k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale)
        out = torch.empty_like(q)
        if plan.decode_rows.numel():
            o = self.kernel(
                q.index_select(0, plan.decode_rows),
                k_cache,
                v_cache,
                plan.decode_tables,
                plan.decode_lens,
                scale,
            )
            out.index_copy_(0, plan.decode_rows, o)
        attend_parts(q, k_cache, v_cache, plan.parts, scale, out)
        return out
