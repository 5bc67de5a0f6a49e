"""python -m batchpage.kernels.lesser_cpu [--if-lower] LEVEL COMMAND [ARGS...]: run COMMAND as it
would run on a CPU of a lower instruction-set level (batchpage.cpu_info.ISA_LEVELS: portable,
avx2, avx512, avx512_vnni), so that what differs there is seen on this machine first (CI runs
the kernel and batch-invariance tests so: the Makefile's `test-avx2`).

BATCHPAGE_CPU_ISA=LEVEL alone holds batchpage to the level: its C++ kernels build for it and
cpu_flags() hides the flags above it. The libraries under it choose their code from the CPU on
their own, once, when they load, so COMMAND gets their settings too: torch's kernels
(ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), MKL (MKL_ENABLE_INSTRUCTIONS), numpy's loops
(NPY_DISABLE_CPU_FEATURES) and numpy's OpenBLAS (OPENBLAS_CORETYPE), which is the matmul of
Triton's interpreter (an AVX2 OpenBLAS sums some rows of a tile in another order than others).
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from batchpage.cpu_info import CPU_ISA_ENV, ISA_LEVELS, isa_level, native_isa_level


class LibraryLevel(NamedTuple):
    """How each library names a level (its setting), and numpy's dispatch targets above it."""

    torch: str  # ATEN_CPU_CAPABILITY
    onednn: str  # ONEDNN_MAX_CPU_ISA
    mkl: str  # MKL_ENABLE_INSTRUCTIONS
    openblas: str  # OPENBLAS_CORETYPE
    numpy_above: tuple[str, ...]  # prefixes of numpy's dispatch targets to turn off


# The highest level needs no entry: no CPU acts as it without being it.
_ABOVE_SKX = ("AVX512_CNL", "AVX512_ICL", "AVX512_SPR")
LIBRARY_LEVELS = {
    "portable": LibraryLevel("default", "SSE41", "SSE4_2", "Nehalem",
                             ("AVX", "F16C", "FMA3", "X86_V3", "X86_V4")),
    "avx2": LibraryLevel("avx2", "AVX2", "AVX2", "Haswell", ("AVX512", "X86_V4")),
    "avx512": LibraryLevel("avx512", "AVX512_CORE", "AVX512", "SkylakeX",
                           ("AVX512_CLX", *_ABOVE_SKX)),
    "avx512_vnni": LibraryLevel("avx512", "AVX512_CORE_VNNI", "AVX512_E1", "SkylakeX", _ABOVE_SKX),
}  # fmt: skip


def lesser_cpu_env(level: str) -> dict[str, str]:
    """The variables that hold batchpage and its libraries to `level`. ValueError when it is not
    a level below this CPU's (isa_level's message)."""
    if isa_level(level) == native_isa_level():
        return {CPU_ISA_ENV: level}
    lib = LIBRARY_LEVELS[level]
    return {
        CPU_ISA_ENV: level,
        "ATEN_CPU_CAPABILITY": lib.torch,
        "ONEDNN_MAX_CPU_ISA": lib.onednn,
        "MKL_ENABLE_INSTRUCTIONS": lib.mkl,
        "OPENBLAS_CORETYPE": lib.openblas,
        "NPY_DISABLE_CPU_FEATURES": " ".join(_numpy_targets(lib.numpy_above)),
    }


def _numpy_targets(prefixes: tuple[str, ...]) -> list[str]:
    """numpy's dispatch targets that start with one of `prefixes` (all it was built with, also
    those this process runs without: under lesser_cpu itself)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__

    return [t for t in __cpu_dispatch__ if t.startswith(prefixes)]


def main(argv: list[str]) -> None:
    """LEVEL COMMAND...; with --if-lower first, a LEVEL that is not below this CPU's (nothing to
    act as: an AVX2 CI machine is one already) runs nothing and exits 0, saying so."""
    if_lower = argv[:1] == ["--if-lower"]
    argv = argv[1:] if if_lower else argv
    names = ", ".join(level.name for level in ISA_LEVELS[:-1])
    if len(argv) < 2:
        print(f"usage: python -m batchpage.kernels.lesser_cpu [--if-lower] LEVEL COMMAND "
              f"[ARGS...]; LEVEL: {names}", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    own, ranks = native_isa_level(), {level.name: i for i, level in enumerate(ISA_LEVELS)}
    if if_lower and ranks.get(argv[0], -1) >= ranks[own.name]:
        print(f"lesser_cpu: this CPU's level is {own.name}, not above {argv[0]}: not run")
        sys.exit(0)
    try:
        env = lesser_cpu_env(argv[0])
    except ValueError as exc:
        print(f"lesser_cpu: {exc}", file=sys.stderr)
        sys.exit(2)
    os.execvpe(argv[1], argv[1:], {**os.environ, **env})


if __name__ == "__main__":
    main(sys.argv[1:])
