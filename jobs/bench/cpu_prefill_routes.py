"""The engine with its CPU prefill rows routed two ways, in one process: through the paged-decode
kernel where the backend's rule says so (the default), against every prompt and chunk on SDPA
(the route before the kernel took prefill rows).

    python -m jobs.bench.cpu_prefill_routes --dtype bfloat16 --runs 4
    python -m jobs.bench.cpu_prefill_routes --smoke        # seconds: does it run?

Workloads are the peer benchmark's (jobs/bench/peer_workloads.py): the shared system prompt and
64 ShareGPT first turns, greedy with ignore_eos. One engine per workload; the two routes take
turns run by run (the attention backend's `prefill_in_kernel` switched between runs) and the
prefix cache is emptied before every run, so each run prefills the same tokens. Reports each
route's median output tok/s, their ratio, and how many requests got the same greedy tokens (in
bf16 two summation orders can part at near-ties).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from batchpage import LLM, SamplingParams
from batchpage.model.loader import load_tokenizer
from jobs.bench.engine_runs import load_llm
from jobs.bench.peer_workloads import PeerWorkload, sharegpt_workload, system_workload
from jobs.bench.report import command_line, environment, log, print_results
from jobs.bench.workloads import short_sharegpt_questions

ROUTES = {"rule": None, "sdpa": False}  # name -> CpuPagedAttention.prefill_in_kernel


def workloads(model: str, smoke: bool) -> list[PeerWorkload]:
    tok = load_tokenizer(model)
    if smoke:
        return [system_workload(tok, short_sharegpt_questions(tok, 4, 0, 16), 40, 2)]
    return [
        system_workload(tok, short_sharegpt_questions(tok, 48, 0, 48), 550, 32),
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


def workload_llm(model: str, dtype: str, w: PeerWorkload) -> LLM:
    """An engine for workload w on the CPU backend, its KV pool sized for it."""
    return load_llm(
        model, f"{w.name} {dtype}", dtype=dtype, attention_backend="cpu", max_model_len=w.max_len,
        kv_cache_memory=2**30,
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
        for name in names[r % 2 :] + names[: r % 2]:
            sides[name](llm)
            rate, tokens[name] = run(llm, w)
            rates[name].append(rate)
            log(f"{label} {name}: {rate:.1f} out tok/s")
    return rates, tokens


def route(prefill_in_kernel: bool | None) -> Callable[[LLM], None]:
    """A side that sends prefill rows one way (CpuPagedAttention.prefill_in_kernel)."""

    def setup(llm: LLM) -> None:
        llm.engine.runner.attention.prefill_in_kernel = prefill_in_kernel

    return setup


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=4, help="runs per route and workload")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="a tiny workload: does it run?")
    args = p.parse_args(argv)
    runs = 1 if args.smoke else args.runs
    rows, results = [], []
    for w in workloads(args.model, args.smoke):
        llm = workload_llm(args.model, args.dtype, w)
        sides = {name: route(r) for name, r in ROUTES.items()}
        rates, tokens = take_turns(llm, w, sides, runs, f"{w.name} {args.dtype}")
        same = sum(a == b for a, b in zip(tokens["rule"], tokens["sdpa"], strict=True))
        med = {name: statistics.median(v) for name, v in rates.items()}
        result = {
            "workload": w.name, "dtype": args.dtype, "runs": rates,
            "rule_tok_s": med["rule"], "sdpa_tok_s": med["sdpa"],
            "rule_vs_sdpa": med["rule"] / med["sdpa"], "same_greedy": same,
            "requests": len(w.prompts),
        }  # fmt: skip
        results.append(result)
        rows.append([w.name, args.dtype, med["rule"], med["sdpa"],
                     f"{result['rule_vs_sdpa']:.3f}x", f"{same}/{len(w.prompts)}"])  # fmt: skip
        del llm
    env = environment()
    print(f"## CPU prefill routes in the engine ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(f"CPU: {env['cpu']} ({', '.join(env['cpu_flags'])}), median of {runs} runs a route.\n")
    header = ["workload", "dtype", "rule out tok/s", "all-SDPA out tok/s", "rule vs all-SDPA",
              "same greedy"]  # fmt: skip
    print_results(header, rows, args.out, env, results)


if __name__ == "__main__":
    main()
