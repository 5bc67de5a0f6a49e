"""Paged decode attention for CPUs: the launcher of a C++ kernel (cpu_paged_decode.cpp, built
once with torch's JIT extension loader).

Why a kernel and not torch ops: in torch, decode attention over the paged pool has to gather
every sequence's K/V blocks into a contiguous copy before SDPA can read them, so each layer moves
the whole batch's context three times (read, write, read again). At 128 sequences of ~300 tokens
that copy is most of a SmolLM2 decode step on a 2-core CPU. This kernel reads each sequence's
blocks in place, once, through its block table: the CPU counterpart of
paged_decode_attention.py (Triton), with the same inputs and the same float32 softmax.

Work split: one task per sequence, handed out one at a time to torch's intra-op threads (OpenMP
dynamic schedule: contexts differ in length). A task reads its blocks front to back, K then V,
and prefetches each next block (it sits at a random place in the pool). It computes all scores
of its context, a float32 softmax, then the weighted sum of V. With a sliding window W the
context is the last W positions: the task starts at the window's first token, so the blocks
before it are never read. A logit soft-cap c turns each score s into c * tanh(s / c).

Two code paths, the same arithmetic (float32 products and sums whatever the cache dtype):
- AVX2 + FMA (every x86 CPU this project targets), head_dim 64 or 128: 8-lane vectors. QK takes
  eight tokens at a time into eight accumulators and reduces them together (one transposing
  hadd tree, not eight horizontal sums); the softmax's exp is a vector polynomial (~1 ulp); PV
  keeps a head's accumulator in registers across a block. bf16 and fp16 caches widen on load.
- plain loops otherwise (other head_dims, other CPUs), which the compiler vectorizes as it can.
On a 2-core AMD EPYC, SmolLM2's shape (`python -m jobs.bench.cpu_attention`): 48 rows x 580
tokens behind a shared, cached prefix take 2.1 ms per layer (the earlier 16-lane generic-vector
code: 7.0 ms, its accumulators spilled to the stack on AVX2); contexts read from memory stream
at 8-11 GB/s, 1.4x-2.4x the earlier code.

The build needs a C++ compiler with OpenMP (g++) and ninja. `CpuPagedDecode.build()` compiles
on first use (about 45 s) into torch's extension folder and reuses the library afterwards; it
raises KernelBuildError, with the compiler's message, when that is impossible.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")  # shipped in the wheel beside this file

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KernelBuildError(RuntimeError):
    pass


log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    """The instruction sets -march=native compiles for: a library built on another CPU (a
    shared cache folder) must not be loaded here."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def extension_name(source: bytes) -> str:
    """The library's name in the extension folder. It changes with the source, the torch build
    and the CPU, so that an edited kernel is rebuilt rather than an old library reloaded."""
    key = hashlib.sha256(b"\n".join([source, torch.__version__.encode(), _cpu_flags().encode()]))
    return f"batchpage_cpu_decode_{key.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH. The PyPI package (a dependency) installs it next
    to the interpreter, which is not always on PATH (a venv used without activating it)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then fails with torch's message, inside KernelBuildError
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _is_built(name: str) -> bool:
    """Whether torch's extension folder already holds this build (then loading takes ~1 s)."""
    from torch.utils import cpp_extension

    try:
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, OSError, RuntimeError):  # a private helper: it may move
        return False
    # ninja rebuilds when the source's path differs from the one the build was made from (a
    # moved checkout), so a library alone does not mean loading is quick.
    try:
        made_from_here = str(SOURCE) in (folder / "build.ninja").read_text()
    except OSError:
        return False
    return made_from_here and (folder / f"{name}.so").exists()


class CpuPagedDecode:
    """The compiled kernel. Build with `CpuPagedDecode.build()`; call like a function."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuPagedDecode:
        """Compiles on first use into torch's extension folder ($TORCH_EXTENSIONS_DIR, default
        ~/.cache/torch_extensions), where later builds of the same source and CPU find it."""
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        try:
            source = SOURCE.read_bytes()
        except OSError as exc:
            raise KernelBuildError(
                f"the CPU paged-decode kernel's source is missing ({exc}): reinstall batchpage, "
                "whose wheel ships kernels/*.cpp; attention_backend='torch' runs without it"
            ) from exc
        name = extension_name(source)
        if not _is_built(name):
            log.info(
                "building the CPU attention kernel %s (about 45 s on 2 cores; once, then cached)",
                name,
            )
        try:
            module = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                extra_ldflags=["-fopenmp"],
                verbose=verbose,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            raise KernelBuildError(
                f"could not build the CPU paged-decode kernel {name}: {exc}. It needs g++ "
                "with OpenMP and ninja (pip install ninja); attention_backend='torch' runs "
                "without them"
            ) from exc
        return cls(module)

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
    ) -> torch.Tensor:  # [N, num_heads, head_dim], q's dtype
        """Row n attends to the first seq_lens[n] tokens of its paged context (its own token is
        the last of them: already written to the pool); with sliding_window W, to the last W of
        them only (keys k > seq_lens[n] - 1 - W, HF's semantics). logit_softcap c: scores
        s * scale become c * tanh(s * scale / c) before the softmax.

        tables_checked: the caller ran `check_tables` on these block_tables and seq_lens for a
        pool of this size (a backend does it once per step, not once per layer: the value
        checks read both tensors)."""
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
            with torch.profiler.record_function("batchpage::cpu_paged_decode"):
                self._module.paged_decode(
                    out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                    sliding_window or 0, logit_softcap or 0.0,
                )  # fmt: skip
        return out
