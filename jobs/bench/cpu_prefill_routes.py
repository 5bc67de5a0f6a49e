"""The engine with its CPU prefill rows routed several ways, in one process (the attention
backend's `prefill_route`, attention/cpu_backend.py): "tiles", the paged-prefill kernel (the
default); "rows", each row a decode through the paged-decode kernel; "sdpa", SDPA over gathered
blocks.

    python -m jobs.bench.cpu_prefill_routes --dtype bfloat16 --runs 4 --routes tiles,rows
    python -m jobs.bench.cpu_prefill_routes --smoke        # seconds: does it run?

Workloads are the peer benchmark's (jobs/bench/peer_workloads.py): the shared system prompt, the
5-shot HumanEval prompt and 64 ShareGPT first turns, greedy with ignore_eos. One engine per
workload; the routes take turns run by run and the prefix cache is emptied before every run, so
each run prefills the same tokens. Reports each route's median output tok/s, its ratio to the
first route's, and how many requests got the first route's greedy tokens (in bf16 two summation
orders can part at near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from batchpage import LLM, SamplingParams
from batchpage.attention.cpu_backend import PREFILL_ROUTES
from batchpage.model.loader import load_tokenizer
from jobs.bench.engine_runs import load_llm
from jobs.bench.peer_workloads import (
    PeerWorkload,
    fewshot_workload,
    sharegpt_workload,
    system_workload,
)
from jobs.bench.report import command_line, environment, log, print_results
from jobs.bench.workloads import short_sharegpt_questions


def workloads(model: str, smoke: bool) -> list[PeerWorkload]:
    tok = load_tokenizer(model)
    if smoke:
        return [system_workload(tok, short_sharegpt_questions(tok, 4, 0, 16), 40, 2)]
    return [
        system_workload(tok, short_sharegpt_questions(tok, 48, 0, 48), 550, 32),
        fewshot_workload(tok, 5, 32, 0, 160, 160, 32),
        sharegpt_workload(tok, 64, 0, 256, 96, 4),
    ]


def run(llm: LLM, w: PeerWorkload) -> tuple[float, list[list[int]]]:
    """(output tok/s, each request's tokens) of one run, from an empty prefix cache."""
    tree = llm.engine.kv_manager.tree
    tree.evict(tree.evictable_blocks)
    assert tree.cached_blocks == 0, "every run prefills the same tokens"
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    start = time.perf_counter()
    outs = llm.generate(w.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def workload_llm(model: str, dtype: str, w: PeerWorkload, **engine_args: Any) -> LLM:
    """An engine for workload w on the CPU backend, its KV pool sized for it (`engine_args`:
    more LLM arguments)."""
    return load_llm(
        model, f"{w.name} {dtype}", dtype=dtype, attention_backend="cpu", max_model_len=w.max_len,
        kv_cache_memory=2**30, **engine_args,
    )  # fmt: skip


def take_turns(
    llm: LLM, w: PeerWorkload, sides: dict[str, Callable[[LLM], object]], runs: int, label: str
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Each side's output tok/s over `runs` runs of w, the sides taking turns in an order that
    alternates, each side's setup applied to the engine before its run; and the tokens of each
    side's last run."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[list[int]]] = {}
    names = list(sides)
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sides[name](llm)
            rate, tokens[name] = run(llm, w)
            rates[name].append(rate)
            log(f"{label} {name}: {rate:.1f} out tok/s")
    return rates, tokens


def route(name: str) -> Callable[[LLM], None]:
    """A side that sends prefill rows one way (CpuPagedAttention.prefill_route)."""

    def setup(llm: LLM) -> None:
        llm.engine.runner.attention.prefill_route = name

    return setup


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=4, help="runs per route and workload")
    p.add_argument(
        "--routes", default="tiles,rows", help=f"comma-separated, of {', '.join(PREFILL_ROUTES)}"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="a tiny workload: does it run?")
    args = p.parse_args(argv)
    runs = 1 if args.smoke else args.runs
    routes = args.routes.split(",")
    if len(routes) < 2 or not set(routes) <= set(PREFILL_ROUTES):
        p.error(f"--routes: two or more of {', '.join(PREFILL_ROUTES)}; got {args.routes!r}")
    first = routes[0]
    rows, results = [], []
    for w in workloads(args.model, args.smoke):
        llm = workload_llm(args.model, args.dtype, w)
        sides = {name: route(name) for name in routes}
        rates, tokens = take_turns(llm, w, sides, runs, f"{w.name} {args.dtype}")
        med = {name: statistics.median(v) for name, v in rates.items()}
        for name in routes[1:]:
            same = sum(a == b for a, b in zip(tokens[first], tokens[name], strict=True))
            result = {
                "workload": w.name, "dtype": args.dtype, "route": name, "runs": rates[name],
                "first_runs": rates[first], "tok_s": med[name], "first_tok_s": med[first],
                "first_vs_route": med[first] / med[name], "same_greedy": same,
                "requests": len(w.prompts),
            }  # fmt: skip
            results.append(result)
            ratio = f"{result['first_vs_route']:.3f}x"
            rows.append([w.name, args.dtype, med[first], name, med[name], ratio,
                         f"{same}/{len(w.prompts)}"])  # fmt: skip
        del llm
    env = environment()
    print(f"## CPU prefill routes in the engine ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(f"CPU: {env['cpu']} ({', '.join(env['cpu_flags'])}), median of {runs} runs a route.\n")
    header = ["workload", "dtype", f"{first} out tok/s", "route", "its out tok/s",
              f"{first} vs route", "same greedy"]  # fmt: skip
    print_results(header, rows, args.out, env, results)


if __name__ == "__main__":
    main()
