"""Paged decode attention for CPUs: the launcher of a C++ kernel (cpu_paged_decode.cpp, built
once with torch's JIT extension loader).

Why a kernel and not torch ops: in torch, decode attention over the paged pool has to gather
every sequence's K/V blocks into a contiguous copy before SDPA can read them, so each layer moves
the whole batch's context three times (read, write, read again), and at decode batch sizes that
copy is most of a small model's step. This kernel reads each sequence's
blocks in place, once, through its block table: the CPU counterpart of
paged_decode_attention.py (Triton), with the same inputs and the same float32 softmax.

The same library writes the step's new K/V rows into their slots (`write_kv`, a memcpy per
token), which the CPU backend calls before attending.

Work split: one task per sequence, handed out one at a time to torch's intra-op threads (OpenMP
dynamic schedule: contexts differ in length). A task reads its blocks front to back, K then V,
and prefetches each next block (it sits at a random place in the pool). It computes all scores
of its context, a float32 softmax, then the weighted sum of V. With a sliding window W the
context is the last W positions: the task starts at the window's first token, so the blocks
before it are never read. A logit soft-cap c turns each score s into c * tanh(s / c).

Three code paths, the same arithmetic (float32 sums whatever the cache dtype):
- AVX-512 (a CPU with AVX-512F, e.g. Zen 4 or a recent Xeon), head_dim 64 or 128: 16-lane
  vectors, sixteen tokens' scores at a time reduced together (sum16 in cpu_vec.h). With a bf16
  cache and AVX512-BF16, QK multiplies q and k as stored (vdpbf16ps: exact products, float32
  sums) and scales the scores, and PV multiplies the softmax weights rounded to bf16 (as HF's
  bf16 attention rounds them before its PV matmul) with V as stored, two tokens per vdpbf16ps,
  the pair unpacked once for all of a kv head's query heads (half the instructions of the
  float32 PV below). Otherwise PV widens bf16 V with a shift and a mask instead of a shuffle. A
  row's blocks are prefetched into L2 when the task starts it (up to 256 KiB), so many misses
  are in flight at once. `python -m jobs.bench.cpu_attention --baseline OLD.cpp` times this
  path against an older source (BENCHMARKS.md, Kernels).
- AVX2 + FMA (every x86 CPU this project targets), head_dim 64 or 128: 8-lane vectors. QK takes
  eight tokens at a time into eight accumulators and reduces them together (one transposing
  hadd tree, not eight horizontal sums); the softmax's exp is a vector polynomial (~1 ulp); PV
  keeps a head's accumulator in registers across a block. bf16 and fp16 caches widen on load.
- plain loops otherwise (other head_dims, other CPUs), which the compiler vectorizes as it can.
The paths are written per vector width rather than as one generic 16-lane vector code, whose
accumulators spill to the stack on AVX2.

`CpuPagedDecode.build()` compiles on first use through cpu_build.py, which caches
the library and raises KernelBuildError, with the compiler's message, when it cannot build.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batchpage.kernels.cpu_build import KernelBuildError, build_extension

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")  # shipped in the wheel beside this file

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["DTYPES", "SOURCE", "CpuPagedDecode", "KernelBuildError"]


class CpuPagedDecode:
    """The compiled kernel. Build with `CpuPagedDecode.build()`; call like a function."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuPagedDecode:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(
            build_extension(SOURCE, "batchpage_cpu_decode", "the CPU paged-decode kernel", verbose)
        )

    @staticmethod
    def check_tables(
        block_tables: torch.Tensor,  # int32 [N, max_blocks]
        seq_lens: torch.Tensor,  # int32 [N]
        num_blocks: int,  # the pool's
        block_size: int,
    ) -> None:
        """The values the kernel trusts: every row sees at least its own token, no context
        outruns its table, and every table entry is a block of the pool."""
        if seq_lens.numel():
            assert int(seq_lens.min()) >= 1, "every row attends to at least its own token"
            assert int(seq_lens.max()) <= block_tables.shape[1] * block_size
            assert int(block_tables.min()) >= 0 and int(block_tables.max()) < num_blocks

    def write_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim], rows may be strided
        value: torch.Tensor,  # [T, num_kv_heads, head_dim], rows may be strided
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]: block * block_size + offset
        slots_checked: bool = False,
        checked: bool = False,
    ) -> None:
        """Store each new token's K/V at its slot: attention/torch_backend.write_kv's arguments
        and result (every slot >= 0), in one pass. slots_checked: the caller checked that every
        slot lies in the pool (a backend does it once per step, not once per layer). checked:
        this step already made this call, checked, with tensors of the same shapes, dtypes and
        strides and the same slots (a backend's layer 0 for its other layers): no checks."""
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        if checked:
            if key.shape[0]:
                self._module.write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        t, kv_heads, dim = key.shape
        assert value.shape == key.shape and slot_mapping.shape == (t,)
        assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, dim)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        for x in (key, value):
            assert x.stride(2) == 1 and x.stride(1) == dim, "K/V rows: [heads, dim] densely"
        if not slots_checked and t:
            capacity = k_cache.shape[0] * k_cache.shape[1]
            assert int(slot_mapping.min()) >= 0 and int(slot_mapping.max()) < capacity
        if t:
            self._module.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def __call__(
        self,
        q: torch.Tensor,  # [N, num_heads, head_dim]: one decode row per sequence
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # int32 [N, max_blocks]
        seq_lens: torch.Tensor,  # int32 [N]: context length, the query's own token included
        scale: float,
        out: torch.Tensor | None = None,  # [N, num_heads, head_dim]
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        tables_checked: bool = False,
        checked: bool = False,
    ) -> torch.Tensor:  # [N, num_heads, head_dim], q's dtype
        """Row n attends to the first seq_lens[n] tokens of its paged context (its own token is
        the last of them: already written to the pool); with sliding_window W, to the last W of
        them only (keys k > seq_lens[n] - 1 - W, HF's semantics). logit_softcap c: scores
        s * scale become c * tanh(s * scale / c) before the softmax.

        tables_checked: the caller ran `check_tables` on these block_tables and seq_lens for a
        pool of this size (a backend does it once per step, not once per layer: the value
        checks read both tensors). checked: this step already made this call, checked, with
        tensors of the same shapes, dtypes and strides and the same tables and lengths (a
        backend's layer 0 for its other layers): no checks; they cost as much as the call at
        decode batch sizes, once per layer."""
        if checked:
            if out is None:
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
            if q.shape[0]:
                self._module.paged_decode(
                    out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                    sliding_window or 0, logit_softcap or 0.0,
                )  # fmt: skip
            return out
        assert sliding_window is None or sliding_window > 0, sliding_window
        assert logit_softcap is None or logit_softcap > 0, logit_softcap
        n, heads, dim = q.shape
        num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
        assert q.device.type == "cpu", "the CPU kernel takes CPU tensors"
        assert q.dtype in DTYPES and k_cache.dtype == v_cache.dtype == q.dtype
        assert v_cache.shape == k_cache.shape and cache_dim == dim and heads % kv_heads == 0
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert q.stride(2) == 1 and q.stride(1) == dim, "q rows must hold [heads, dim] densely"
        assert block_tables.dtype == seq_lens.dtype == torch.int32
        assert block_tables.dim() == 2 and block_tables.shape[0] == n
        assert block_tables.is_contiguous() and seq_lens.shape == (n,)
        assert seq_lens.is_contiguous()
        if not tables_checked:
            self.check_tables(block_tables, seq_lens, num_blocks, block_size)
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert out.stride(2) == 1 and out.stride(1) == dim
        if n:
            self._module.paged_decode(
                out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                sliding_window or 0, logit_softcap or 0.0,
            )  # fmt: skip
        return out
