"""The engine's own work on sampled rows against greedy ones, at N running sequences.

    python -m jobs.bench.sampled --model $(python -m jobs.bench.random_models tiny) \
        --running 64,512,1024 --out jobs/bench/results/sampled_tiny_float32.json

For each N: N prompts of random ids (--prompt-tokens each), max_num_seqs N, each generating
--max-tokens tokens (ignore_eos), once greedy and once sampled (temperature 0.8, top-k 50,
top-p 0.95, min-p 0.01, each request with its own seed), taking turns --rounds times (each
side's best round counts). Reports output tok/s and the mean ms a decode-only step (no prompt
token computed) spends in each part of its own work (RunStats.step_time_s; the forward apart).
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from batchpage import SamplingParams
from batchpage.model.loader import resolve_model_source
from jobs.bench import report
from jobs.bench.engine_runs import load_llm, log, timed_steps
from jobs.bench.workloads import random_workload

MODES = ("greedy", "sampled")


def params_of(mode: str, n: int, max_tokens: int) -> list[SamplingParams]:
    if mode == "greedy":
        return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * n
    return [
        SamplingParams(
            temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=i, max_tokens=max_tokens,
            ignore_eos=True,
        )
        for i in range(n)
    ]  # fmt: skip


def run(args: argparse.Namespace, vocab: int, n: int) -> list[dict[str, Any]]:
    prompts = random_workload(vocab, n, (args.prompt_tokens,) * 2, args.max_tokens, seed=n).prompts
    llm = load_llm(
        args.model, f"sampled {n}", dtype=args.dtype, max_num_seqs=n, max_model_len=512,
        kv_cache_memory=args.kv_cache_gib * 2**30,
    )  # fmt: skip
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            got = timed_steps(llm, prompts, params_of(mode, n, args.max_tokens))
            got.pop("outputs")
            log(f"{n} running, {mode}: {got['output_tok_s']:.1f} out tok/s")
            if mode not in best or got["output_tok_s"] > best[mode]["output_tok_s"]:
                best[mode] = got
    del llm
    gc.collect()
    return [{"running": n, "mode": mode, **best[mode]} for mode in MODES]


def table(results: list[dict[str, Any]]) -> str:
    parts = [p for p in results[0]["decode_parts"] if p != "forward"]
    headers = ["running", "rows", "out tok/s", "decode-only steps", "forward ms",
               *(f"{p} ms" for p in parts), "own work ms"]  # fmt: skip
    rows = []
    for r in results:
        ms = r["decode_parts"]
        own = sum(ms[p] for p in parts)
        rows.append([r["running"], r["mode"], report.fmt(r["output_tok_s"]), r["decode_steps"],
                     report.fmt(ms["forward"], 2), *(report.fmt(ms[p], 2) for p in parts),
                     report.fmt(own, 2)])  # fmt: skip
    return report.markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    p.add_argument("--model", required=True, help="bundled name, .gguf file or HF folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--running", default="64,512", help="comma list of N")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.smoke:
        args.running, args.max_tokens, args.rounds = "4", 4, 1
    env = report.environment()
    vocab = resolve_model_source(args.model).config.vocab_size
    results = [r for n in report.ints(args.running) for r in run(args, vocab, n)]
    report.print_header("Greedy against sampled rows", env, f"model {args.model}, {args.dtype}")
    print(table(results))
    report.save_results(args.out, env, results, args)


if __name__ == "__main__":
    main()
