"""The CPU attention backend: C++ kernels that read the pool in place. Decode rows (one new
token) go to the paged-decode kernel (kernels/cpu_paged_decode.py), a row per task; the rows of
a prompt, a chunk or a prompt behind a cached prefix go to the paged-prefill kernel
(kernels/cpu_paged_prefill.py), which reads each key once for a tile of rows. Sliding windows
and logit soft-caps go to both (see backend.py).

Batch-invariant (EngineConfig.batch_invariant): every row goes to the prefill kernel, decodes
too. The two kernels sum in different orders (the decode kernel a whole softmax at once, the
prefill kernel an online one over chunks of keys fixed by position), so a token computed once by
each (a decode, then recomputed after a preemption, or read as a cached prefix) would differ;
one kernel, whose sums for a row do not depend on the other rows of its tile, does not.

A sequence whose image rows see their whole span (AttentionMetadata.span_seqs: Gemma 3) skips
the prefill kernel, which attends causally: it attends through the torch parts (spans.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.spans import SpanParts
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill


@dataclass(frozen=True)
class CpuStepAttention:
    """A step planned by CpuPagedAttention: its decode rows for the decode kernel, its sequences
    with several new rows for the prefill kernel."""

    kernel: CpuPagedDecode
    prefill: CpuPagedPrefill
    meta: AttentionMetadata
    all_in_kernel: bool  # every row is a decode, in order (decode_rows unused)
    decode_rows: torch.Tensor  # int64 [Nk]: the rows for the decode kernel
    decode_tables: torch.Tensor  # int32 [Nk, max_blocks]: each kernel row's sequence's table
    decode_lens: torch.Tensor  # int32 [Nk]: the context each kernel row sees, itself included
    prefill_seqs: torch.Tensor  # int32 [S]: the sequences whose rows the prefill kernel takes
    spans: SpanParts | None = None  # the sequences whose rows see past themselves (spans.py)

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
        # Every layer of a step passes the same slots, tables and lengths, and q/k/v and pool
        # layers of the same shapes, dtypes and strides (one head count and head_dim per model,
        # one pool shape per layer): the kernels check them in layer 0, which every forward runs
        # first, and take the other layers' calls unchecked.
        checked = layer > 0
        self.kernel.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, checked=checked)
        q = q.to(k_cache.dtype)
        # q's rows may be strided (its heads are a slice of the q/k rows): the kernels take a
        # row stride, so only a q whose heads are not dense is copied.
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        window = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
        if self.all_in_kernel:
            return self.kernel(
                q, k_cache, v_cache, self.decode_tables, self.decode_lens, scale, **window,
                checked=checked,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype)
        if self.decode_rows.numel():
            o = self.kernel(
                q.index_select(0, self.decode_rows),
                k_cache,
                v_cache,
                self.decode_tables,
                self.decode_lens,
                scale,
                **window,
                checked=checked,
            )
            out.index_copy_(0, self.decode_rows, o)
        self.prefill(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.prefill_seqs, scale, out, **window, tables_checked=checked,
        )  # fmt: skip
        if self.spans is not None:
            self.spans.attend(q, k_cache, v_cache, sliding_window, scale, out, logit_softcap)
        return out


class CpuPagedAttention:
    """AttentionBackend for CPU tensors (see backend.py for the contract): decodes through the
    decode kernel; a sequence with several new tokens (a prompt, a chunk, a prompt behind a
    cached prefix) through the prefill kernel. Tests compare it with the torch backend."""

    def __init__(
        self, kernel: CpuPagedDecode, prefill: CpuPagedPrefill, batch_invariant: bool = False
    ) -> None:
        self.kernel = kernel
        self.prefill = prefill
        self.batch_invariant = batch_invariant

    def plan(self, meta: AttentionMetadata) -> CpuStepAttention:
        if meta.is_decode_only and not self.batch_invariant:
            none = torch.empty(0, dtype=torch.long)
            return CpuStepAttention(
                self.kernel, self.prefill, meta, True, none, meta.block_tables, meta.seq_lens,
                none.int(),
            )  # fmt: skip
        # Over the step's sequences as tensors, not one by one: a decode step with drafts
        # (several new rows per sequence) then plans in the same Python at any batch size.
        lens = torch.tensor(meta.query_lens_cpu, dtype=torch.long)
        one = (lens == 1) & (not self.batch_invariant)
        # A decode row is its sequence's only new row: it sees the sequence's whole context.
        seqs = torch.nonzero(one).flatten()
        extend = (lens > 1) | self.batch_invariant
        if meta.span_seqs:
            extend[torch.tensor(meta.span_seqs, dtype=torch.long)] = False
        return CpuStepAttention(
            self.kernel,
            self.prefill,
            meta,
            False,
            meta.query_start_loc.index_select(0, seqs).long(),
            meta.block_tables.index_select(0, seqs),
            meta.seq_lens.index_select(0, seqs),
            torch.nonzero(extend).flatten().int(),
            SpanParts.of(meta),
        )
