"""What this CPU is and which dtype is fast on it, read from /proc/cpuinfo.

Native bf16 (AVX-512 BF16 or AMX) multiplies twice as many bfloat16 pairs per instruction as
float32 FMAs, so a bfloat16 matmul is the faster one; without it torch emulates bf16 and the same
matmul is slower than float32 (BENCHMARKS.md, "Other benchmarks": dtype per CPU). The engine's
dtype="auto" on a CPU follows these flags.
"""

from __future__ import annotations

import platform
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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
    """The instruction-set flags of the first CPU (empty where /proc/cpuinfo is not readable)."""
    return frozenset((_field("flags") or "").split())


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)
