"""Nightly HumanEval: generate with batchpage, score pass@1, keep a history, print the change.

    python -m jobs.nightly_eval                             # all 164 problems, the bundled model
    python -m jobs.nightly_eval dataset.limit=20 model.path=/models/ckpt engine.block_size=32

1. Runs the job of conf/experiment/nightly_humaneval.yaml (greedy, into nightly/runs/<date>,
   score=humaneval), with the Hydra overrides given here: `python -m batchpage.run
   +experiment=nightly_humaneval` runs the same job alone. A rerun on the same day resumes it; a
   changed model or sampling is refused unless overwrite=true. The job poses HumanEval in the
   form the model answers (dataset.style) and checks every completion in batchpage's sandbox
   (batchpage.scoring): scores.parquet, pass@1 in run.json.
2. Appends a row to the history Parquet and prints the change since the last comparable run
   (same model path, same number of problems), with the problems that flipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.fileio import atomic_path

EXPERIMENT = "+experiment=nightly_humaneval"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--history",
        type=Path,
        default=Path("nightly/history.parquet"),
        help="every run's pass@1 is appended here",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of the job, e.g. dataset.limit=20 model.path=/models/x "
        "output_dir=runs/today overwrite=true",
    )
    return p.parse_intermixed_args(argv)


# --- history -------------------------------------------------------------------------------------


def append_history(path: Path, row: dict[str, Any]) -> dict[str, Any] | None:
    """Append `row` (atomically) and return the last earlier row of the same model and size."""
    old = pq.read_table(path).to_pylist() if path.exists() else []
    same = [r for r in old if r["model"] == row["model"] and r["problems"] == row["problems"]]
    rows = [*old, row]
    columns = dict.fromkeys(key for r in rows for key in r)  # older rows may lack new columns
    with atomic_path(path) as tmp:
        pq.write_table(pa.table({key: [r.get(key) for r in rows] for key in columns}), tmp)
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
    from batchpage.run import compose_job, run_for_script

    args = parse_args(argv)
    done = run_for_script(lambda: compose_job([EXPERIMENT, *args.overrides]))
    if done is None:
        return 2
    cfg, result = done
    if result.score is None:
        print("error: the nightly job must score: keep score=humaneval", file=sys.stderr)
        return 2
    metrics = json.loads((result.output_dir / "run.json").read_text())["metrics"]
    scores = pq.read_table(result.output_dir / "scores.parquet").to_pylist()
    row = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": cfg.model.path,
        "problems": result.score["problems"],
        "pass_at_1": result.score["pass_at_1"],
        "passed": len({s["id"] for s in scores if s["passed"]}),
        "errors": result.errors,
        "passed_tasks": sorted({s["id"] for s in scores if s["passed"]}),
        "generated_tokens": int(metrics["generated_tokens"]),
        "output_tokens_per_s": float(metrics["output_tokens_per_s"] or 0.0),
        "output_dir": str(result.output_dir),
        "sampling": json.dumps(dataclasses.asdict(cfg.sampling), sort_keys=True, default=str),
        "style": cfg.dataset.style,
    }
    print(report(row, append_history(args.history, row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
