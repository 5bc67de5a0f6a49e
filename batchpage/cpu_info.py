"""What this CPU is and which dtype is fast on it, read from /proc/cpuinfo.

Native bf16 (AVX-512 BF16 or AMX) multiplies twice as many bfloat16 pairs per instruction as
float32 FMAs, so a bfloat16 matmul is the faster one; without it torch emulates bf16 and the same
matmul is slower than float32 (BENCHMARKS.md, "Other benchmarks": dtype per CPU). The engine's
dtype="auto" on a CPU follows these flags.

The CPU's instruction-set level (ISA_LEVELS) picks what the C++ kernels are compiled for, so that
CPUs of one level share one build. BATCHPAGE_CPU_ISA=avx2 (or any lower level) makes batchpage
act as a CPU of that level would: the kernels build for it and cpu_flags() hides the flags above
it (dtype="auto" then picks float32 on a Zen 4 too). batchpage.kernels.lesser_cpu runs a command
so, with torch, numpy and their BLAS libraries held to the level as well.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import NamedTuple

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPU_ISA_ENV = "BATCHPAGE_CPU_ISA"


class IsaLevel(NamedTuple):
    name: str
    needs: frozenset[str]  # the /proc/cpuinfo flags of the instructions the level compiles for


_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
# From the least to the most; each needs what the one before it needs. The kernels test for
# AVX2 + FMA + F16C, AVX-512 F/BW/DQ/VL, VNNI and BF16 (cpu_vec.h, the .cpp files).
ISA_LEVELS = (
    IsaLevel("portable", frozenset()),
    IsaLevel("avx2", _AVX2),  # Haswell, Zen 1 to 3
    IsaLevel("avx512", _AVX512),  # Skylake-SP
    IsaLevel("avx512_vnni", _AVX512 | {"avx512_vnni"}),  # Cascade Lake, Ice Lake
    IsaLevel("avx512_bf16", _AVX512 | {"avx512_vnni", "avx512_bf16"}),  # Zen 4, Sapphire Rapids
)


def _field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _field("model name") or platform.processor() or platform.machine()


def cpu_mhz() -> float:
    """The first CPU's clock as /proc/cpuinfo reports it (2000 where it does not)."""
    try:
        return float(_field("cpu MHz") or 2000.0)
    except ValueError:
        return 2000.0


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of the first CPU (empty where /proc/cpuinfo is not readable),
    as a CPU of isa_level() has them: under BATCHPAGE_CPU_ISA, without those above its level."""
    flags = _real_flags()
    if not os.environ.get(CPU_ISA_ENV):
        return flags
    return frozenset(f for f in flags if f in isa_level().needs or not _vector_flag(f))


def isa_level(wanted: str | None = None) -> IsaLevel:
    """The level named `wanted` (default: $BATCHPAGE_CPU_ISA), or this CPU's own where none is
    named. A name that is not a level, or a level above this CPU's, raises ValueError (its code
    would not run here)."""
    wanted = os.environ.get(CPU_ISA_ENV, "") if wanted is None else wanted
    own = native_isa_level()
    if not wanted:
        return own
    names = [level.name for level in ISA_LEVELS]
    if wanted not in names:
        raise ValueError(f"{CPU_ISA_ENV} must be one of {', '.join(names)}; got {wanted!r}")
    level = ISA_LEVELS[names.index(wanted)]
    if not level.needs <= _real_flags():
        missing = ", ".join(sorted(level.needs - _real_flags()))
        raise ValueError(
            f"{CPU_ISA_ENV}={wanted}: this CPU lacks {missing} (its level is {own.name}); "
            "it can only act as a lower level"
        )
    return level


def native_isa_level() -> IsaLevel:
    """The highest level this CPU has, whatever BATCHPAGE_CPU_ISA says."""
    flags = _real_flags()
    return [level for level in ISA_LEVELS if level.needs <= flags][-1]


def _real_flags() -> frozenset[str]:
    return frozenset((_field("flags") or "").split())


def _vector_flag(flag: str) -> bool:
    """A flag of the vector and matrix extensions that the levels order (AVX, AVX-512, AMX)."""
    return flag.startswith(("avx", "amx")) or flag in ("fma", "f16c")


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)
