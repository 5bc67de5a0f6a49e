"""Paged prefill attention for CPUs: the launcher of a C++ kernel (cpu_paged_prefill.cpp, built
once with torch's JIT extension loader, like cpu_paged_decode).

A prompt, a chunk of one, or the new tokens behind a cached prefix are several query rows of one
sequence, each seeing the context up to its own position. Sent one row at a time through the
decode kernel, every row reads the whole context again; gathered for SDPA, the context is copied
and every row is multiplied with every key (a causal mask does not let SDPA skip any). This
kernel reads each key once for a tile of rows, in place, through the block table, and stops at
the tile's last row: the CPU counterpart of extend_attention.py (Triton). `python -m
jobs.bench.cpu_attention` times it against the torch backend (BENCHMARKS.md, Kernels).

Work split: one task per tile, `64 // group` consecutive rows of one sequence times one kv head
(group = query heads per kv head; a group over 64 is split over tiles of one row), so a task
holds up to 64 query vectors; tasks go to torch's intra-op threads longest context first, one at
a time (OpenMP dynamic schedule). A task walks its context in chunks of 16 keys (never across a
block): the scores of every query vector against the chunk's keys with the vector lanes over
query vectors (each key broadcast, q stored transposed once per tile; with a bf16 pool on a CPU
with AVX512-BF16, `vdpbf16ps` on q and k as stored), an online softmax (running maximum and sum,
float32), then the chunk's V into float32 accumulators held in registers (with AVX512-BF16 and a
bf16 pool, by `vdpbf16ps` on the weights rounded to bf16, as HF's bf16 attention rounds them,
and V as stored: two keys per instruction, half the float32 pass's work, which counts most
behind long cached prefixes). One code runs in 16
lanes (AVX-512), 8 (AVX2) or 1 (any CPU; also any head_dim other than 64 and 128). Keys past a
row's position or before its window (sliding_window W: keys p - W < k <= p, HF's semantics) are
masked to -inf. A logit soft-cap c turns each score s into c * tanh(s / c) before the mask.

`CpuPagedPrefill.build()` compiles on first use through cpu_build.py, which caches
the library and raises KernelBuildError, with the compiler's message, when it cannot build.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batchpage.kernels.cpu_build import KernelBuildError, build_extension
from batchpage.kernels.cpu_paged_decode import DTYPES, CpuPagedDecode

SOURCE = Path(__file__).with_name("cpu_paged_prefill.cpp")  # shipped in the wheel beside this file

__all__ = ["SOURCE", "CpuPagedPrefill", "KernelBuildError"]


class CpuPagedPrefill:
    """The compiled kernel. Build with `CpuPagedPrefill.build()`; call like a function."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuPagedPrefill:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(
            build_extension(
                SOURCE, "batchpage_cpu_prefill", "the CPU paged-prefill kernel", verbose
            )
        )

    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]: the step's query rows
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # int32 [B, max_blocks]
        seq_lens: torch.Tensor,  # int32 [B]: each sequence's context, its new tokens included
        query_start: torch.Tensor,  # int32 [B + 1]: sequence b owns rows [qs[b], qs[b + 1])
        seqs: torch.Tensor,  # int32 [S]: the sequences whose rows this call attends
        scale: float,
        out: torch.Tensor,  # [T, num_heads, head_dim]: the rows of `seqs` are written
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        tables_checked: bool = False,
    ) -> torch.Tensor:
        """Row j of sequence b (n = qs[b + 1] - qs[b] new tokens) sits at position
        seq_lens[b] - n + j and attends to the keys at positions up to its own (already written
        to the pool); with sliding_window W, to the last W of them. Other rows of `out` are
        left as they are.

        tables_checked: the caller ran `CpuPagedDecode.check_tables` on these block_tables and
        seq_lens for a pool of this size (once per step, not once per layer)."""
        assert sliding_window is None or sliding_window > 0, sliding_window
        assert logit_softcap is None or logit_softcap > 0, logit_softcap
        t, heads, dim = q.shape
        num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
        b = seq_lens.shape[0]
        assert q.device.type == "cpu", "the CPU kernel takes CPU tensors"
        assert q.dtype in DTYPES and k_cache.dtype == v_cache.dtype == q.dtype
        assert v_cache.shape == k_cache.shape and cache_dim == dim and heads % kv_heads == 0
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert q.stride(2) == 1 and q.stride(1) == dim, "q rows must hold [heads, dim] densely"
        assert out.shape == q.shape and out.dtype == q.dtype
        assert out.stride(2) == 1 and out.stride(1) == dim
        for x in (block_tables, seq_lens, query_start, seqs):
            assert x.dtype == torch.int32 and x.is_contiguous()
        assert block_tables.dim() == 2 and block_tables.shape[0] == b
        assert query_start.shape == (b + 1,) and seqs.dim() == 1
        if not tables_checked:
            CpuPagedDecode.check_tables(block_tables, seq_lens, num_blocks, block_size)
            starts = query_start.long()
            assert int(starts[0]) == 0 and int(starts[-1]) == t
            n = starts[1:] - starts[:-1]
            assert bool((n >= 0).all()) and bool((n <= seq_lens.long()).all())
            if seqs.numel():
                assert int(seqs.min()) >= 0 and int(seqs.max()) < b
        if seqs.numel():
            with torch.profiler.record_function("batchpage::cpu_paged_prefill"):
                self._module.paged_prefill(
                    out, q, k_cache, v_cache, block_tables, seq_lens, query_start, seqs,
                    scale, sliding_window or 0, logit_softcap or 0.0,
                )  # fmt: skip
        return out
