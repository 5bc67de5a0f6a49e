"""How much of this CPU's matmul ceiling each system of a peers run reached (issue #15's "half of
the matmul ceiling on the 512-request ShareGPT run").

    python -m jobs.bench.peers_ceiling bench/peers_float32.json [--out bench/ceiling.json]

Rebuilds the run's workloads from the arguments its JSON recorded (the same seed, so the same
token ids), measures the model's linears on this CPU in each dtype of the run (the best of
F.linear and oneDNN's prepacked path: jobs/bench/ceiling.py), and prints, per workload and
system, the useful output tok/s against the workload's bound: the least time its prompts and
outputs could take at those matmul rates. The bound computes every prompt token, so a workload
whose prompts mostly hit the prefix cache (system, fewshot) can exceed 100%; the ShareGPT
workloads share little. Run it on the machine that made the JSON, and on a quiet one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.ceiling import measure_matmul_ceiling
from jobs.bench.peers import build_workloads
from jobs.bench.report import command_line, environment, log, markdown_table, write_json


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peers_json", type=Path, help="the --out file of jobs.bench.peers")
    p.add_argument("--ceiling-tokens", default="64,256,512", help="matmul M values to time")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    run: dict[str, Any] = json.loads(args.peers_json.read_text())
    run_args = argparse.Namespace(**run["args"])
    source = resolve_model_source(run_args.model)
    workloads = {w.name: w for w in build_workloads(run_args, load_tokenizer(source))}
    tokens = [int(m) for m in args.ceiling_tokens.split(",")]

    rows, results = [], []
    for dtype in run_args.dtypes.split(","):
        ceiling, _ = measure_matmul_ceiling(source.config, tokens, getattr(torch, dtype))
        log(f"{dtype} matmul ceiling measured")
        for r in run["results"]:
            if r["dtype"] != dtype or r["workload"] not in workloads:
                continue
            w = workloads[r["workload"]]
            bound = w.output_tokens / ceiling.workload_seconds(w.as_requests())
            share = r["output_tok_s"] / bound
            results.append(dict(r, bound_tok_s=bound, ceiling_share=share))
            rows.append(
                [dtype, r["workload"], r["system"], f"{r['output_tok_s']:.1f}", f"{bound:.1f}",
                 f"{share:.1%}"]
            )  # fmt: skip
    env = environment()
    print(f"## Share of the matmul ceiling ({env['date_utc']})\n")
    print(f"`{command_line()}`, CPU: {env.get('cpu', 'unknown')}\n")
    print(
        markdown_table(
            ["dtype", "workload", "system", "output tok/s", "matmul bound tok/s", "share"], rows
        )
    )
    if args.out:
        write_json(args.out, {"command": command_line(), "environment": env, "rows": results})


if __name__ == "__main__":
    main()
