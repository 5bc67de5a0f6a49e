"""`make setup` builds the C++ kernels that this CPU binds ahead (python -m
batchpage.kernels.build_all; --all: every one), saying what it builds and how long each took, so
the first job does not compile at first use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from batchpage.cpu_info import cpu_flags

ROOT = Path(__file__).resolve().parents[2]


def test_make_setup_builds_the_kernels() -> None:
    done = subprocess.run(
        ["make", "-n", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "-m batchpage.kernels.build_all" in done.stdout


EVERY = [
    "the CPU paged-decode kernel",
    "the CPU paged-prefill kernel",
    "the CPU layer ops",
    "the bf16 linear",
    "the float32 linear",
    "the int linear",
    "the int8-activation linear",
    "the LoRA kernel",
]


def build_all(*args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.kernels.build_all", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def built(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := re.match(r"building (.*) \.\.\.$", line))]


def ready(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := re.match(r"  (.*) ready in \d+\.\d s$", line))]


def test_build_all_builds_what_this_cpu_binds_and_says_how_long_each_took() -> None:
    # This CPU's own choice (test_cpu_isa.py checks the choice for other CPUs), as this process
    # sees the CPU (BATCHPAGE_CPU_ISA may hold it to a lower level).
    flags = cpu_flags()
    if "avx512_bf16" in flags:  # bfloat16 jobs
        want = [*EVERY[:3], "the bf16 linear", "the int linear"]
        a8 = "avx512_vnni" in flags or {"avx2", "fma"} <= flags
        want += ["the int8-activation linear"] if a8 else []
    else:  # float32 jobs
        want = [*EVERY[:3], "the float32 linear"]
        if {"avx2", "fma"} <= flags:
            want += ["the int linear", "the int8-activation linear"]
    lines = build_all()
    assert sorted(built(lines)) == sorted(want)  # several at a time: in the order they start
    assert sorted(ready(lines)) == sorted(want)
    later = len(EVERY) - len(want)
    assert re.match(rf"{len(want)} of {len(want)} kernels ready in \d+\.\d s \({later} more at "
                    r"first use\)$", lines[-1])  # fmt: skip


def test_build_all_builds_every_kernel_when_asked() -> None:
    lines = build_all("--all")
    assert sorted(built(lines)) == sorted(ready(lines)) == sorted(EVERY)
    assert re.match(r"8 of 8 kernels ready in \d+\.\d s$", lines[-1])
