"""The `batchpage` console script (batchpage/cli.py): what a subcommand does with arguments it
does not take, and without the extra it needs. Each runs in a child process, as the script does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def console(args: list[str], hide: str | None = None) -> subprocess.CompletedProcess[str]:
    """`batchpage <args>`; `hide`: a top-level module made unimportable, as if not installed."""
    setup = f"sys.modules[{hide!r}] = None; " if hide else ""
    code = f"import sys; {setup}from batchpage.cli import main; main(sys.argv[1:])"
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_lm_eval_without_lm_eval_is_one_line_and_exit_2() -> None:
    done = console(["lm-eval", "--tasks", "x"], hide="lm_eval")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "batchpage lm-eval: batchpage.lm_eval needs lm-evaluation-harness: pip install "
        "'batchpage[lm_eval]'"
    ]


def test_a_missing_module_of_batchpage_itself_keeps_its_traceback() -> None:
    """Only a missing dependency is the one line: a broken install shows where it broke."""
    done = console(["lm-eval", "--tasks", "x"], hide="batchpage.llm")
    assert done.returncode == 1 and "Traceback" in done.stderr, done.stderr


def test_build_kernels_refuses_arguments_it_does_not_take() -> None:
    done = console(["build-kernels", "--force", "extra"])
    assert done.returncode == 2, done.stderr
    assert "unrecognized arguments: --force extra" in done.stderr
    assert "building" not in done.stdout  # refused before any kernel is built
    helped = console(["build-kernels", "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: ")
    assert "building" not in helped.stdout
