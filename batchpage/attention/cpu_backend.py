"""The CPU attention backend: C++ kernels that read the pool in place. Decode rows (one new
token) go to the paged-decode kernel (kernels/cpu_paged_decode.py), a row per task; the rows of
a prompt, a chunk or a prompt behind a cached prefix go to the paged-prefill kernel
(kernels/cpu_paged_prefill.py), which reads each key once for a tile of rows. Sliding windows
and logit soft-caps go to both (see backend.py).

Two other routes for a sequence's new rows stay for comparison (`prefill_route`, and
jobs/bench/cpu_prefill_attention.py): "rows", each row a decode of its own position through the
decode kernel, and "sdpa", the torch parts (parts.py: SDPA over gathered blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import StepParts, attend_parts
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill

PrefillRoute = Literal["tiles", "rows", "sdpa"]
PREFILL_ROUTES: tuple[PrefillRoute, ...] = ("tiles", "rows", "sdpa")


@dataclass(frozen=True)
class CpuStepAttention:
    """A step planned by CpuPagedAttention: its rows for the decode kernel, its sequences for the
    prefill kernel, and the rest (route "sdpa") as torch parts."""

    kernel: CpuPagedDecode
    prefill: CpuPagedPrefill
    meta: AttentionMetadata
    all_in_kernel: bool  # every row goes to the decode kernel, in order (decode_rows unused)
    decode_rows: torch.Tensor  # int64 [Nk]: the rows for the decode kernel
    decode_tables: torch.Tensor  # int32 [Nk, max_blocks]: each kernel row's sequence's table
    decode_lens: torch.Tensor  # int32 [Nk]: the context each kernel row sees, itself included
    prefill_seqs: torch.Tensor  # int32 [S]: the sequences whose rows the prefill kernel takes
    parts: StepParts  # the sequences left for the torch path

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
        if self.prefill_seqs.numel():
            self.prefill(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                self.prefill_seqs, scale, out, **window, tables_checked=checked,
            )  # fmt: skip
        attend_parts(q, k_cache, v_cache, self.parts(sliding_window), scale, out, logit_softcap)
        return out


class CpuPagedAttention:
    """AttentionBackend for CPU tensors (see backend.py for the contract).

    Decodes always run through the decode kernel. A sequence with several new tokens (a prompt,
    a chunk, a prompt behind a cached prefix) goes by `prefill_route`: "tiles" (the default) to
    the prefill kernel; "rows" to the decode kernel, each row a decode of its own position;
    "sdpa" to the torch parts, SDPA over gathered blocks (parts.py). Tests compare every route
    with the torch backend; jobs/bench/cpu_prefill_attention.py times them."""

    def __init__(
        self,
        kernel: CpuPagedDecode,
        prefill: CpuPagedPrefill,
        prefill_route: PrefillRoute = "tiles",
    ) -> None:
        if prefill_route not in PREFILL_ROUTES:
            raise ValueError(
                f"prefill_route must be one of {PREFILL_ROUTES}; got {prefill_route!r}"
            )
        self.kernel = kernel
        self.prefill = prefill
        self.prefill_route = prefill_route

    def plan(self, meta: AttentionMetadata) -> CpuStepAttention:
        lens = meta.query_lens_cpu
        route = self.prefill_route
        # Sequences whose rows go to the decode kernel: decodes, and every sequence by "rows".
        seqs = [b for b, n in enumerate(lens) if n == 1 or route == "rows"]
        multi = [b for b, n in enumerate(lens) if n > 1]
        none = torch.empty(0, dtype=torch.int32)
        if len(seqs) == meta.num_seqs:
            rows = torch.empty(0, dtype=torch.long)
            tables, sees = meta.block_tables, meta.seq_lens
            if not meta.is_decode_only:
                tables, sees, rows = self._rows(meta, seqs)
            return CpuStepAttention(
                self.kernel, self.prefill, meta, True, rows, tables, sees, none,
                StepParts(meta, decode_rows=False, skip=frozenset(range(meta.num_seqs))),
            )  # fmt: skip
        tables, sees, rows = self._rows(meta, seqs)
        tiles = torch.tensor(multi, dtype=torch.int32) if route == "tiles" else none
        done = frozenset(seqs) | (frozenset(multi) if route == "tiles" else frozenset())
        return CpuStepAttention(
            self.kernel, self.prefill, meta, False, rows, tables, sees, tiles,
            StepParts(meta, decode_rows=False, skip=done),
        )  # fmt: skip

    @staticmethod
    def _rows(
        meta: AttentionMetadata, seqs: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode kernel's inputs for every row of `seqs`: each row's table, the context it
        sees, and the row's index in the step."""
        lens = meta.query_lens_cpu
        starts = meta.query_start_loc.tolist()
        # Row r = starts[b] + j of sequence b (n new tokens of a context of L) sits at position
        # L - n + j, so it sees the first L - n + j + 1 tokens of b's blocks.
        rows = [r for b in seqs for r in range(starts[b], starts[b + 1])]
        of_seq = torch.tensor([b for b in seqs for _ in range(lens[b])], dtype=torch.long)
        sees = [meta.seq_lens_cpu[b] - lens[b] + 1 + j for b in seqs for j in range(lens[b])]
        return (
            meta.block_tables.index_select(0, of_seq),
            torch.tensor(sees, dtype=torch.int32),
            torch.tensor(rows, dtype=torch.long),
        )
