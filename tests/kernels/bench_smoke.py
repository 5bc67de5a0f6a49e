"""Running a benchmark under jobs/bench as a user would, in a subprocess from the repository
root: the tests check what it prints and writes, never its internals (tests do not import jobs/)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    module: str,
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <args...>` in `cwd` (the repository root unless given; jobs/ is found
    from anywhere), its output captured; the caller checks the exit code."""
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def run_bench_smoke(module: str, out: Path, *extra: str) -> tuple[str, list[dict[str, Any]]]:
    """`python -m <module> --smoke --out <out> [extra...]`: (its stdout, the results it wrote).
    Fails the test with its stderr when it exits non-zero."""
    done = run_bench(module, "--smoke", "--out", str(out), *extra)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(out.read_text())["results"]


def markdown_tables(stdout: str) -> list[list[dict[str, str]]]:
    """Every Markdown table a benchmark printed, in order: its rows as cells by header (an
    escaped pipe inside a cell stays in that cell)."""
    lines = stdout.splitlines()
    found: list[list[dict[str, str]]] = []
    for i, line in enumerate(lines[:-1]):
        starts = line.startswith("|") and lines[i + 1].startswith("|---")
        if not starts or (i > 0 and lines[i - 1].startswith("|")):
            continue
        headers, rows = _cells(line), []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append(dict(zip(headers, _cells(row), strict=True)))
        found.append(rows)
    return found


def table_with(tables: list[list[dict[str, str]]], header: str) -> list[dict[str, str]]:
    """The first of `tables` with a column named `header`."""
    return next(t for t in tables if t and header in t[0])


def _cells(row: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]]
