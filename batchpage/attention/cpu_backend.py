"""The CPU attention backend: decode rows through the C++ paged-decode kernel, which reads the
pool in place (kernels/cpu_paged_decode.py); rows of a sequence with several new tokens (prefill,
a prefill chunk) through the torch parts (parts.py), whose cost there is the attention itself,
not the gather. Sliding windows and logit soft-caps go to both (see backend.py for their meaning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import StepParts, attend_parts
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode


@dataclass(frozen=True)
class CpuStepAttention:
    """A step planned by CpuPagedAttention: its decode rows for the kernel, the rest as parts."""

    kernel: CpuPagedDecode
    meta: AttentionMetadata
    all_decode: bool  # every sequence has one new token: rows and sequences coincide
    decode_rows: torch.Tensor  # int64 [Nd]: the one-token sequences' rows
    decode_tables: torch.Tensor  # int32 [Nd, max_blocks]
    decode_lens: torch.Tensor  # int32 [Nd]
    parts: StepParts  # everything else, for the torch path

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        check_planned_for(self.meta, meta)
        check_window_and_softcap(sliding_window, logit_softcap)
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        # The step's slots and tables are the same in every layer: their values are checked in
        # the first (every forward runs layer 0 first), the shapes in each.
        self.kernel.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, slots_checked=layer > 0)
        q = q.to(k_cache.dtype)
        window = {
            "sliding_window": sliding_window,
            "logit_softcap": logit_softcap,
            "tables_checked": layer > 0,
        }
        if self.all_decode:
            # q's rows may be strided (its heads are a slice of the q/k rows): the kernel takes
            # a row stride, so only a q whose heads are not dense is copied.
            if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
                q = q.contiguous()
            return self.kernel(
                q, k_cache, v_cache, self.decode_tables, self.decode_lens, scale, **window
            )
        q = q.contiguous()
        out = torch.empty_like(q)
        if self.decode_rows.numel():
            o = self.kernel(
                q.index_select(0, self.decode_rows),
                k_cache,
                v_cache,
                self.decode_tables,
                self.decode_lens,
                scale,
                **window,
            )
            out.index_copy_(0, self.decode_rows, o)
        attend_parts(q, k_cache, v_cache, self.parts(sliding_window), scale, out, logit_softcap)
        return out


class CpuPagedAttention:
    """AttentionBackend for CPU tensors (see backend.py for the contract)."""

    def __init__(self, kernel: CpuPagedDecode) -> None:
        self.kernel = kernel

    def plan(self, meta: AttentionMetadata) -> CpuStepAttention:
        if meta.is_decode_only:
            return CpuStepAttention(
                self.kernel,
                meta,
                True,
                torch.empty(0),
                meta.block_tables,
                meta.seq_lens,
                StepParts(meta, decode_rows=False),
            )
        decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        index = torch.tensor(decode, dtype=torch.long)
        return CpuStepAttention(
            self.kernel,
            meta,
            False,
            meta.query_start_loc[:-1].long()[index],
            meta.block_tables[index].contiguous(),
            meta.seq_lens[index].contiguous(),
            StepParts(meta, decode_rows=False),
        )
