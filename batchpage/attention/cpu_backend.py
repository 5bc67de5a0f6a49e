"""The CPU attention backend: query rows through the C++ paged-decode kernel, which reads the
pool in place (kernels/cpu_paged_decode.py). A decode is one row; a prompt or a chunk is one row
per new token, each a decode of its own position, so a causal prompt costs only the keys its
rows see and nothing is gathered. The rows of a long chunk behind a long cached context go to
the torch parts instead (parts.py: SDPA over gathered blocks), where `kernel_is_cheaper` says
SDPA's matmuls win. Sliding windows and logit soft-caps go to both (see backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchpage.attention.backend import check_planned_for, check_window_and_softcap
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.parts import StepParts, attend_parts
from batchpage.cache.kv_cache import KVCache
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode

# The kernel reads each row's visible keys one row at a time, about 31 ns a key per row in
# either dtype on a 2-core AMD EPYC with AVX-512 (Zen 4, the only CPU these were measured on);
# SDPA multiplies every query row of a sequence with every gathered key (a causal mask does not
# let it skip the rest) at about 20 ns a key per row, plus about 0.3 ms a sequence for the
# gather and the call. Measured with `python -m jobs.bench.cpu_prefill_attention`
# (BENCHMARKS.md, "Prefill rows through the decode kernel").
SDPA_KEY_COST = 0.65  # SDPA's time per query row and key, in units of the kernel's
SDPA_CALL_COST = 10_000  # SDPA's time per sequence, in keys the kernel reads in that time


def kernel_is_cheaper(new: int, context: int) -> bool:
    """Whether `new` query rows ending a context of `context` tokens run faster through the
    kernel than through SDPA: yes for decodes, fresh prompts and short chunks; no for long
    chunks after a long cached context, where SDPA's matmuls pay off."""
    kernel_keys = new * (context - new) + new * (new + 1) // 2  # row j sees context - new + j + 1
    return kernel_keys <= SDPA_KEY_COST * new * context + SDPA_CALL_COST


@dataclass(frozen=True)
class CpuStepAttention:
    """A step planned by CpuPagedAttention: its decode rows for the kernel, the rest as parts."""

    kernel: CpuPagedDecode
    meta: AttentionMetadata
    all_in_kernel: bool  # every row goes to the kernel, in order (decode_rows is then unused)
    decode_rows: torch.Tensor  # int64 [Nk]: the rows for the kernel
    decode_tables: torch.Tensor  # int32 [Nk, max_blocks]: each kernel row's sequence's table
    decode_lens: torch.Tensor  # int32 [Nk]: the context each kernel row sees, itself included
    parts: StepParts  # the sequences with more new tokens, for the torch path

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
        if self.all_in_kernel:
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
    """AttentionBackend for CPU tensors (see backend.py for the contract).

    Decodes always run through the kernel. A sequence with several new tokens (a prompt, a
    chunk, a prompt behind a cached prefix) sends its rows there too, each as a decode of its
    own position over the pool in place, where `kernel_is_cheaper` says so; the others go to
    SDPA over gathered blocks (parts.py). prefill_in_kernel=True or False sends all of them one
    way (tests compare both against the torch backend)."""

    def __init__(self, kernel: CpuPagedDecode, prefill_in_kernel: bool | None = None) -> None:
        self.kernel = kernel
        self.prefill_in_kernel = prefill_in_kernel

    def _in_kernel(self, new: int, context: int) -> bool:
        if new == 1:
            return True
        if self.prefill_in_kernel is None:
            return kernel_is_cheaper(new, context)
        return self.prefill_in_kernel

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
        lens = meta.query_lens_cpu
        seqs = [b for b, n in enumerate(lens) if self._in_kernel(n, meta.seq_lens_cpu[b])]
        starts = meta.query_start_loc.tolist()
        # Row r = starts[b] + j of sequence b (n new tokens of a context of L) sits at position
        # L - n + j, so it sees the first L - n + j + 1 tokens of b's blocks.
        rows = [r for b in seqs for r in range(starts[b], starts[b + 1])]
        of_seq = torch.tensor([b for b in seqs for _ in range(lens[b])], dtype=torch.long)
        sees = [meta.seq_lens_cpu[b] - lens[b] + 1 + j for b in seqs for j in range(lens[b])]
        return CpuStepAttention(
            self.kernel,
            meta,
            len(rows) == meta.num_tokens,
            torch.tensor(rows, dtype=torch.long),
            meta.block_tables.index_select(0, of_seq),
            torch.tensor(sees, dtype=torch.int32),
            StepParts(meta, decode_rows=False, skip=frozenset(seqs)),
        )
