"""`make setup` builds the eight C++ kernels ahead (python -m batchpage.kernels.build_all), saying
what it builds and how long each took, so the first job does not compile at first use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_setup_builds_the_kernels() -> None:
    done = subprocess.run(
        ["make", "-n", "setup"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "-m batchpage.kernels.build_all" in done.stdout


def test_build_all_builds_every_kernel_and_says_how_long_each_took() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "batchpage.kernels.build_all"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    built = [m.group(1) for line in lines if (m := re.match(r"building (.*) \.\.\.$", line))]
    assert built == [
        "the CPU paged-decode kernel",
        "the CPU paged-prefill kernel",
        "the CPU layer ops",
        "the bf16 linear",
        "the float32 linear",
        "the int linear",
        "the int8-activation linear",
        "the LoRA kernel",
    ]
    assert sum(bool(re.match(r"  ready in \d+\.\d s$", line)) for line in lines) == 8
    assert re.match(r"8 of 8 kernels ready in \d+\.\d s$", lines[-1])
