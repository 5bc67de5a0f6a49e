"""python -m batchpage.kernels.build_all: build the eight C++ CPU kernels now (`make setup` runs
it), so that the first job starts generating at once instead of compiling for minutes.

Each kernel is built through its own builder (cpu_build.py caches the library by its sources
and build inputs), and one line says what is built and how long it took; a kernel already
built is only loaded. Exit code 0 when every kernel built, 1 when one could not (the line says
why; the engine then runs torch's path for it, with a warning).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from batchpage.kernels.cpu_a8_linear import CpuA8Linear
from batchpage.kernels.cpu_bf16_linear import CpuBf16Linear
from batchpage.kernels.cpu_build import KernelBuildError
from batchpage.kernels.cpu_f32_linear import CpuF32Linear
from batchpage.kernels.cpu_int_linear import CpuIntLinear
from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.kernels.cpu_lora import CpuLoRA
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill


def builders() -> list[tuple[str, Callable[[], object]]]:
    """What the engine builds at first use on a CPU, in the order it needs them."""
    return [
        ("the CPU paged-decode kernel", CpuPagedDecode.build),
        ("the CPU paged-prefill kernel", CpuPagedPrefill.build),
        ("the CPU layer ops", CpuLayerOps.build),
        ("the bf16 linear", CpuBf16Linear.build),
        ("the float32 linear", CpuF32Linear.build),
        ("the int linear", CpuIntLinear.build),
        ("the int8-activation linear", CpuA8Linear.build),
        ("the LoRA kernel", CpuLoRA.build),
    ]


def build_all(out: Callable[[str], None] = print) -> int:
    """Build every kernel, saying before and after each; returns how many failed."""
    failed = 0
    total = time.perf_counter()
    for what, build in builders():
        out(f"building {what} ...")
        started = time.perf_counter()
        try:
            build()
        except KernelBuildError as e:
            failed += 1
            out(f"  failed after {time.perf_counter() - started:.1f} s: {e}")
            continue
        out(f"  ready in {time.perf_counter() - started:.1f} s")
    out(f"{len(builders()) - failed} of {len(builders())} kernels ready in "
        f"{time.perf_counter() - total:.1f} s")  # fmt: skip
    return failed


def main() -> None:
    def say(line: str) -> None:
        print(line, flush=True)

    sys.exit(1 if build_all(say) else 0)


if __name__ == "__main__":
    main()
