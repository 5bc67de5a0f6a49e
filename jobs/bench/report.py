"""What every benchmark shares: its arguments (--out, --smoke, comma lists), timing (medians of
calls taking turns), the machine, the exact command, Markdown tables for BENCHMARKS.md (on
stdout), progress (on stderr) and the JSON file."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from batchpage.cpu_info import cpu_flags, cpu_model, has_native_bf16
from jobs.bench.engine_runs import log

__all__ = ["cpu_model", "log"]  # re-exported: one progress format, one CPU name for all
T = TypeVar("T")
# Copies of a weight or of K/V blocks taken in turn, together this large (four times a big L3),
# so that each call reads its operands from memory as a decode step does.
COLD_BYTES = 128 * 2**20


# --- arguments ---------------------------------------------------------------------------------


def parser(doc: str | None, smoke: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as help, --out and (unless smoke=False) --smoke."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    if smoke:
        p.add_argument("--smoke", action="store_true", help="tiny sizes: does it run?")
    return p


def ints(text: str | int) -> list[int]:
    """A comma list of integers ("1,16,64")."""
    return [int(x) for x in str(text).split(",") if x]


# --- timing ------------------------------------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn's result, wall-clock seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def in_turns(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each fn after one warm-up call each, the fns taking turns (one
    call each per round), so that a drift of a shared machine's speed reaches them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn)[1])
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def cold_copies(nbytes: int, most: int) -> int:
    """How many copies of an operand of `nbytes` reach COLD_BYTES together (at most `most`)."""
    return max(1, min(most, -(-COLD_BYTES // nbytes)))


# --- provenance --------------------------------------------------------------------------------


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


def machine(env: dict[str, Any]) -> str:
    """The machine in one line: what decides which kernels and dtype ran."""
    native = "yes" if env["native_bf16"] else "no"
    flags = ", ".join(env["cpu_flags"]) or "none"
    return (f"CPU {env['cpu']} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), "
            f"flags {flags}; native bf16: {native}; torch {env['torch']}")  # fmt: skip


def print_header(title: str, env: dict[str, Any], *notes: str) -> None:
    """A report's opening: its title and date, the command, the machine and any notes."""
    print(f"## {title} ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print("; ".join([machine(env), *notes]) + ".\n")


# --- JSON --------------------------------------------------------------------------------------


def write_json(path: str | Path, data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def save_results(
    out: str | Path | None, env: dict[str, Any], results: Any, args: Any = None, **extra: Any
) -> None:
    """A benchmark's results as JSON beside the command, the environment and (an argparse
    Namespace) the arguments that made them; nothing when out is None."""
    if out is None:
        return
    if args is not None:
        extra["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
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
