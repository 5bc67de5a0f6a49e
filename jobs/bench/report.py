"""What every benchmark result carries and how it prints: the timing, the machine, the exact
command, Markdown tables for BENCHMARKS.md (on stdout) and progress (on stderr), and the JSON
file."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from batchpage.cpu_info import cpu_flags, cpu_model, has_native_bf16

T = TypeVar("T")


# --- timing and provenance ---------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn's result, wall-clock seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def command_line() -> str:
    """The exact command that produced a result, ready to paste into a shell: the module the
    benchmarks run as (python -m jobs.bench.<name>) rather than the path of its file."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    head = ["python", "-m", module] if module else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def environment() -> dict[str, Any]:
    import transformers

    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_model(),
        # The flags that decide the fast dtype (batchpage/cpu_info.py) and the kernels' width.
        "cpu_flags": sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}),
        "native_bf16": has_native_bf16(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the clean Markdown report."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- JSON --------------------------------------------------------------------------------------


def args_json(args: Any) -> dict[str, Any]:
    """An argparse Namespace as JSON-ready values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def save_results(out: str | Path, env: dict[str, Any], results: Any, **extra: Any) -> None:
    """A benchmark's results as JSON beside the command and the environment that made them."""
    write_json(out, {"command": command_line(), "environment": env, **extra, "results": results})
    print(f"\nJSON: {out}")


# --- tables ------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers as a table shows them: thousands separators, fixed decimals; None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def pct(x: float) -> str:
    return f"{x:.1%}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are formatted with `fmt`, numbers right-aligned."""
    body = [[fmt(c) for c in row] for row in rows]
    align = [
        bool(body) and all(_looks_numeric(row[i]) for row in body) for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if a else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _looks_numeric(cell: str) -> bool:
    stripped = cell.replace(",", "").replace("%", "").replace("x", "").strip()
    if stripped in ("", "-"):
        return True
    try:
        float(stripped)
    except ValueError:
        return False
    return True
