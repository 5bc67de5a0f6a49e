"""python -m batchpage.kernels.build_all [--all]: build the C++ CPU kernels that the engine binds on
this CPU now (`make setup` runs it), so that the first job starts generating at once instead of
compiling for minutes. --all builds all eight.

"What the engine binds" is the kernels of a job at dtype="auto" (bfloat16 on a CPU with native
bf16, else float32: batchpage.cpu_info), a quantized checkpoint (the bundled model's) included:
the attention kernels and the layer ops everywhere, the bf16 or the float32 linear, the int
linear and the int8-activation one where their vector paths run (AVX2 + FMA; AVX512-BF16 or
AVX512-VNNI). The LoRA
kernel, and the linears of the other dtype, are built at first use (with a log line), as any
kernel missing from the cache is.

Each kernel is built through its own builder (cpu_build.py caches the library by content), as
many at a time as there are cores, and one line says what is built and how long it took; a kernel
already built is only loaded. Exit
code 0 when every kernel built, 1 when one could not (the line says why; the engine then runs
torch's path for it, with a warning).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from batchpage.cpu_info import cpu_flags, has_native_bf16
from batchpage.kernels.cpu_a8_linear import CpuA8Linear
from batchpage.kernels.cpu_bf16_linear import CpuBf16Linear
from batchpage.kernels.cpu_build import KernelBuildError
from batchpage.kernels.cpu_f32_linear import CpuF32Linear
from batchpage.kernels.cpu_int_linear import CpuIntLinear
from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.kernels.cpu_lora import CpuLoRA
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill


class Kernel(NamedTuple):
    what: str
    build: Callable[[], object]
    # Whether a dtype="auto" job binds it on a CPU with these flags (the engine's own tests:
    # ops/bf16_linear.py, ops/f32_linear.py, ops/int_linear.py).
    bound: Callable[[frozenset[str]], bool]


def _always(flags: frozenset[str]) -> bool:
    return True


def _bf16_linear(flags: frozenset[str]) -> bool:
    return has_native_bf16(flags) and "avx512_bf16" in flags


def _f32_linear(flags: frozenset[str]) -> bool:
    return not has_native_bf16(flags)


def _int_linear(flags: frozenset[str]) -> bool:
    return {"avx2", "fma"} <= flags or _bf16_linear(flags)


def _a8_linear(flags: frozenset[str]) -> bool:
    # ops/int_linear.py offers its VNNI path and its AVX2 one (bf16 and float32 rows)
    return {"avx2", "fma"} <= flags or (_bf16_linear(flags) and "avx512_vnni" in flags)


def _first_use(flags: frozenset[str]) -> bool:
    return False


def kernels() -> list[Kernel]:
    """Every kernel, in the order the engine needs them."""
    return [
        Kernel("the CPU paged-decode kernel", CpuPagedDecode.build, _always),
        Kernel("the CPU paged-prefill kernel", CpuPagedPrefill.build, _always),
        Kernel("the CPU layer ops", CpuLayerOps.build, _always),
        Kernel("the bf16 linear", CpuBf16Linear.build, _bf16_linear),
        Kernel("the float32 linear", CpuF32Linear.build, _f32_linear),
        Kernel("the int linear", CpuIntLinear.build, _int_linear),
        Kernel("the int8-activation linear", CpuA8Linear.build, _a8_linear),
        Kernel("the LoRA kernel", CpuLoRA.build, _first_use),
    ]


def bound_here(flags: frozenset[str]) -> list[Kernel]:
    """The kernels a job binds on a CPU with `flags`."""
    return [k for k in kernels() if k.bound(flags)]


def build_all(out: Callable[[str], None] = print, everything: bool = False) -> int:
    """Build the kernels this CPU binds (`everything`: all), one per core at a time (a kernel is
    one compile, on one core), saying when each starts and ends; returns how many failed."""
    chosen = kernels() if everything else bound_here(cpu_flags())
    say = threading.Lock()

    def build(kernel: Kernel) -> bool:
        with say:
            out(f"building {kernel.what} ...")
        started = time.perf_counter()
        try:
            kernel.build()
        except KernelBuildError as e:
            with say:
                out(f"  {kernel.what} failed after {time.perf_counter() - started:.1f} s: {e}")
            return False
        with say:
            out(f"  {kernel.what} ready in {time.perf_counter() - started:.1f} s")
        return True

    total = time.perf_counter()
    workers = max(1, min(len(chosen), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="build") as pool:
        failed = sum(not ok for ok in pool.map(build, chosen))
    later = "" if everything else f" ({len(kernels()) - len(chosen)} more at first use)"
    out(f"{len(chosen) - failed} of {len(chosen)} kernels ready in "
        f"{time.perf_counter() - total:.1f} s{later}")  # fmt: skip
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m batchpage.kernels.build_all")
    parser.add_argument("--all", action="store_true", help="all eight kernels, not only these")
    args = parser.parse_args()

    def say(line: str) -> None:
        print(line, flush=True)

    sys.exit(1 if build_all(say, everything=args.all) else 0)


if __name__ == "__main__":
    main()
