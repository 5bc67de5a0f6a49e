"""Nightly HumanEval: generate with batchpage, score pass@1, keep a history, print the change.

    python -m jobs.nightly_eval                             # all 164 problems, the bundled model
    python -m jobs.nightly_eval dataset.limit=20 model.path=/models/ckpt engine.block_size=32

1. Runs the job of conf/experiment/nightly_humaneval.yaml (greedy, into nightly/runs/<date>,
   score=humaneval), with the Hydra overrides given here: `python -m batchpage.run
   +experiment=nightly_humaneval` runs the same job alone. A rerun on the same day resumes it; a
   changed model or sampling is refused unless overwrite=true. The job poses HumanEval in the
   form the model answers (dataset.style) and checks every completion in batchpage's sandbox
   (batchpage.humaneval): scores.parquet, pass@1 in run.json.
2. With --lm-eval-tasks, also runs those lm-evaluation-harness tasks through batchpage's lm-eval
   backend on the same model (results in <run>/lm_eval.json, headline metrics in the history).
3. Appends a row to the history Parquet and prints the change since the last comparable run
   (same model path, same number of problems), with the problems that flipped.

    python -m jobs.nightly_eval --lm-eval-tasks arc_easy,my_task --lm-eval-include-path tasks/
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
    p.add_argument("--lm-eval-tasks", default="", help="comma-separated lm-eval task names")
    p.add_argument(
        "--lm-eval-include-path", type=Path, default=None, help="a folder of local task YAMLs"
    )
    p.add_argument("--lm-eval-limit", type=int, default=None, help="samples per task (quick runs)")
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
    from batchpage.storage import Stores

    out = result.output_dir  # a folder or a URL: read through its store
    store = Stores(cfg.storage).store_for(out)
    metrics = json.loads(store.read_bytes(store.join(out, "run.json")))["metrics"]
    with store.open_read(store.join(out, "scores.parquet")) as f:
        scores = pq.read_table(f).to_pylist()
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
        "output_dir": out,
        "sampling": json.dumps(dataclasses.asdict(cfg.sampling), sort_keys=True, default=str),
        "style": cfg.dataset.style,
    }
    if args.lm_eval_tasks:
        row["lm_eval"] = json.dumps(run_lm_eval(cfg, args, out), sort_keys=True)
    print(report(row, append_history(args.history, row)))
    if "lm_eval" in row:
        print(f"lm-eval: {row['lm_eval']}")
    return 0


def run_lm_eval(cfg: Any, args: argparse.Namespace, out: str) -> dict[str, dict[str, float]]:
    """The tasks through the batchpage backend, on the job's model and engine settings; the
    full results go to <out>/lm_eval.json, each task's numeric metrics are returned."""
    import lm_eval
    import lm_eval.tasks  # lm_eval loads its submodules lazily: TaskManager needs this import

    import batchpage.lm_eval  # noqa: F401  (registers the model "batchpage")

    engine = {k: v for k, v in dataclasses.asdict(cfg.engine).items() if v is not None}
    model_args = ",".join(
        [f"pretrained={cfg.model.path}", *(f"{k}={v}" for k, v in engine.items())]
    )
    manager = lm_eval.tasks.TaskManager(
        include_path=str(args.lm_eval_include_path) if args.lm_eval_include_path else None
    )
    results = lm_eval.simple_evaluate(
        model="batchpage",
        model_args=model_args,
        tasks=args.lm_eval_tasks.split(","),
        task_manager=manager,
        limit=args.lm_eval_limit,
    )
    from batchpage.storage import Stores

    store = Stores(cfg.storage).store_for(out)
    text = json.dumps(results["results"], indent=2, default=str)
    store.write_bytes(store.join(out, "lm_eval.json"), text.encode())
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, float)}
        for task, metrics in results["results"].items()
    }


if __name__ == "__main__":
    sys.exit(main())
