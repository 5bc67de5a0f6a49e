"""The CPU's instruction-set level, and acting as a lower one: BATCHPAGE_CPU_ISA holds batchpage to
a level (its kernels build for it, cpu_flags() hides what is above it, so dtype="auto" and the
linears choose as on such a CPU), and `python -m batchpage.kernels.lesser_cpu LEVEL CMD` holds
torch, numpy and their BLAS libraries to it too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchpage import cpu_info
from batchpage.cpu_info import cpu_flags, has_native_bf16, isa_level, native_isa_level
from batchpage.kernels.build_all import bound_here
from batchpage.kernels.lesser_cpu import lesser_cpu_env
from batchpage.model.config import ModelConfig
from batchpage.model.loader import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
SSE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt"}
HASWELL = frozenset(SSE | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"})
SKYLAKE_SP = HASWELL | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
ZEN4 = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "avx512vbmi", "avx512_vbmi2", "vaes"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile", "avx512_fp16", "avx_vnni"}
ABOVE_AVX2 = ("avx512", "amx", "avx_")  # the flags an AVX2-only CPU (Haswell, Zen 2) lacks


@pytest.fixture
def cpu(monkeypatch):
    """Make this process see a CPU with the given flags."""

    def use(flags: frozenset[str]) -> None:
        monkeypatch.setattr(cpu_info, "_field", lambda name: " ".join(sorted(flags)))

    monkeypatch.delenv("BATCHPAGE_CPU_ISA", raising=False)
    return use


@pytest.mark.parametrize(
    ("flags", "level"),
    [(frozenset(SSE), "portable"), (HASWELL, "avx2"), (SKYLAKE_SP, "avx512"),
     (SKYLAKE_SP | {"avx512_vnni"}, "avx512_vnni"), (ZEN4, "avx512_bf16"),
     (SAPPHIRE_RAPIDS, "avx512_bf16"), (HASWELL - {"fma"}, "portable")],
)  # fmt: skip
def test_a_cpu_has_the_highest_level_whose_flags_it_has(cpu, flags, level) -> None:
    cpu(flags)
    assert native_isa_level().name == level == isa_level().name


@pytest.mark.parametrize("real", [ZEN4, SAPPHIRE_RAPIDS, HASWELL])
def test_acting_as_avx2_hides_the_flags_above_it(cpu, monkeypatch, real) -> None:
    cpu(real)
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "avx2")
    assert isa_level().name == "avx2"
    flags = cpu_flags()
    assert {"avx2", "fma", "f16c", "sse4_2", "bmi2"} <= flags
    assert not [f for f in flags if f.startswith(ABOVE_AVX2)]
    assert not has_native_bf16()
    config = ModelConfig.__new__(ModelConfig)  # resolve_dtype reads no field on a CPU
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "portable")
    assert not [f for f in cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]


def test_the_level_named_must_be_one_this_cpu_has(cpu, monkeypatch) -> None:
    cpu(HASWELL)
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="this CPU lacks avx512bw, avx512cd"):
        isa_level()
    monkeypatch.setenv("BATCHPAGE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="must be one of portable, avx2, avx512"):
        cpu_flags()
    with pytest.raises(ValueError, match="must be one of"):
        lesser_cpu_env("sse9")


@pytest.mark.parametrize(
    ("flags", "built"),
    [(ZEN4, ["bf16", "int", "int8-activation"]), (HASWELL, ["float32", "int", "int8-activation"]),
     (SKYLAKE_SP, ["float32", "int", "int8-activation"]), (frozenset(SSE), ["float32"])],
)  # fmt: skip
def test_setup_builds_what_a_dtype_auto_job_binds_on_the_cpu(flags, built) -> None:
    """bfloat16 on a CPU with AVX512-BF16 (its linear, the int linear, the int8-activation one),
    float32 elsewhere (its linear; the int and int8-activation linears where AVX2 + FMA run
    them); LoRA at first use."""
    attention = ["the CPU paged-decode kernel", "the CPU paged-prefill kernel", "the CPU layer ops"]
    want = attention + [f"the {name} linear" for name in built]
    assert [k.what for k in bound_here(flags)] == want


def test_lesser_cpu_holds_the_libraries_to_the_level(cpu) -> None:
    cpu(ZEN4)
    env = lesser_cpu_env("avx2")
    assert env["BATCHPAGE_CPU_ISA"] == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["OPENBLAS_CORETYPE"] == "Haswell"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert lesser_cpu_env("avx512_bf16") == {"BATCHPAGE_CPU_ISA": "avx512_bf16"}  # its own


@pytest.mark.skipif(native_isa_level().name == "portable", reason="no level below the CPU's")
def test_a_command_under_lesser_cpu_sees_the_lower_level() -> None:
    probe = (
        "import numpy, torch\n"
        "from numpy._core._multiarray_umath import __cpu_features__ as npy\n"
        "from batchpage.cpu_info import cpu_flags, isa_level\n"
        "print(isa_level().name, torch.backends.cpu.get_cpu_capability(),\n"
        "      'avx512f' in cpu_flags(), bool(npy.get('X86_V3')), bool(npy.get('X86_V4')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.kernels.lesser_cpu", "portable",
         sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["portable", "DEFAULT", "False", "False", "False"]


def test_if_lower_runs_nothing_on_a_cpu_that_is_not_above_the_level() -> None:
    """CI's AVX2 run on a CI machine that is an AVX2 one already (or less): nothing to act as."""
    own = native_isa_level().name
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.kernels.lesser_cpu", "--if-lower", own,
         sys.executable, "-c", "raise SystemExit(3)"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "not run" in done.stdout, done


def test_ci_runs_the_kernel_and_batch_invariance_tests_as_an_avx2_cpu() -> None:
    done = subprocess.run(
        ["make", "-n", "test-avx2"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    run = " ".join(done.stdout.replace("\\\n", " ").split())
    assert "-m batchpage.kernels.lesser_cpu --if-lower avx2 " in run
    assert "pytest" in run and "tests/kernels tests/engine/test_batch_invariant.py" in run
    assert "make test-avx2" in (ROOT / ".ci" / "run").read_text().splitlines()
