"""Running a benchmark under jobs/bench as a user would, in a subprocess from the repository
root: the tests check what it prints and writes, never its internals (tests do not import jobs/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <args...>` from the repository root, its output captured; the caller
    checks the exit code."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def run_bench_smoke(module: str, out: Path, *extra: str) -> tuple[str, list[dict[str, Any]]]:
    """`python -m <module> --smoke --out <out> [extra...]`: (its stdout, the results it wrote).
    Fails the test with its stderr when it exits non-zero."""
    done = run_bench(module, "--smoke", "--out", str(out), *extra)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(out.read_text())["results"]
