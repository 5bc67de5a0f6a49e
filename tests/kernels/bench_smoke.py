"""Running a kernel benchmark under jobs/bench with --smoke, as its tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench_smoke(module: str, out: Path, *extra: str) -> tuple[str, list[dict[str, Any]]]:
    """`python -m <module> --smoke --out <out> [extra...]` from the repository root: (its stdout,
    the results it wrote). Fails the test with its stderr when it exits non-zero."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", module, "--smoke", "--out", str(out), *extra],
        cwd=root, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(out.read_text())["results"]
