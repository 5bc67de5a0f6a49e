"""Prefix sharing on this CPU: the radix prefix cache on vs off, and whole-job prefix ordering.

    python -m jobs.bench.prefix --out bench/prefix.json     # the real measurement
    python -m jobs.bench.prefix --smoke                     # < 1 minute: does it run?

Three workloads, greedy with ignore_eos so every configuration generates the same tokens:

1. system: many requests share one long system prompt (a support assistant's instructions, cut
   to --system-tokens tokens) followed by a short, distinct ShareGPT question each; chat template.
2. fewshot: a k-shot HumanEval prompt (k finished problems, prompt + canonical solution) shared
   by many other HumanEval problems to complete; plain text, as a completion eval would send it.
3. schedule: a shuffled mix of several long shared prefixes (ShareGPT replies as documents in
   the system turn) with short questions, on a KV pool that caches only --mix-cached-prefixes of
   them at a time: schedule=prefix (the whole job ordered so that a prefix's requests run back to
   back) vs schedule=fcfs (input order).

Workloads 1 and 2 run on two engines that differ only in prefix_caching; their pool holds every
request at once, so cache off never preempts and the difference is the prefill compute alone.
Prefill saved = 1 - prefill tokens computed with the cache / without. Speedup = wall time of
the whole generate call without / with. Prints Markdown tables; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.kv_manager import blocks_for
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.engine_runs import GenerateRun, load_llm, same_outputs, timed_generate
from jobs.bench.prefix_workloads import (
    Workload,
    few_shot_workload,
    mixed_prefix_workload,
    per_prefix_shared_tokens,
    system_prompt_workload,
)
from jobs.bench.report import (
    args_json,
    command_line,
    environment,
    fmt,
    log,
    markdown_table,
    pct,
    write_json,
)
from jobs.bench.workloads import short_sharegpt_questions

TARGET_PREFILL_SAVED = 0.85
TARGET_SPEEDUP = 2.5

# --- runs --------------------------------------------------------------------------------------


def run_cache_on_off(
    args: argparse.Namespace, workloads: list[Workload], bytes_per_token: int
) -> dict[str, dict[str, GenerateRun]]:
    """Each workload on an engine with the prefix cache and on one without; otherwise equal. The
    pool holds every request of the largest workload at once, so neither engine preempts."""
    bs = args.block_size
    pool_tokens = bs * max(len(w.prompts) * blocks_for(w.max_len + bs, bs) for w in workloads)
    max_model_len = bs * blocks_for(max(w.max_len for w in workloads), bs)
    runs: dict[str, dict[str, GenerateRun]] = {w.name: {} for w in workloads}
    for caching in (True, False):
        label = "cache on" if caching else "cache off"
        llm = load_llm(
            args.model,
            label,
            block_size=bs,
            kv_cache_memory=pool_tokens * bytes_per_token,
            max_model_len=max_model_len,
            prefix_caching=caching,
        )
        # Different workloads share no block-sized prefix (chat template vs plain code), so the
        # cache left by one cannot help the next.
        for w in workloads:
            run = timed_generate(llm, w.prompts, w.params(), f"{w.name}, {label}")
            runs[w.name][label] = run
            log(f"{w.name}, {label}: {run.wall_s:.1f} s, prefill computed "
                f"{run.stats['prefill_tokens_computed']:,}")  # fmt: skip
        del llm
        gc.collect()  # free this pool before the next engine allocates its own
    return runs


def run_schedules(
    args: argparse.Namespace, workload: Workload, bytes_per_token: int
) -> tuple[dict[str, GenerateRun], dict[str, Any]]:
    """schedule=prefix vs fcfs with the cache on, on a pool that holds only
    --mix-cached-prefixes documents plus the running sequences' own tokens."""
    bs = args.block_size
    shared = per_prefix_shared_tokens(workload)
    longest = max(len(p) for p in workload.prompts)
    # Per running sequence: its own suffix and outputs, plus a partial block each side.
    private = bs * (blocks_for(longest - shared + workload.max_tokens, bs) + 2)
    cached = bs * blocks_for(shared, bs)
    pool_tokens = args.mix_cached_prefixes * cached + args.mix_max_num_seqs * private
    max_model_len = bs * blocks_for(workload.max_len, bs)
    if pool_tokens < max_model_len:
        pool_tokens = max_model_len  # the engine refuses a pool that cannot hold one sequence
    pool = {
        "pool_tokens": pool_tokens,
        "pool_blocks": pool_tokens // bs,
        "shared_tokens_per_prefix": shared,
        "cached_prefixes": args.mix_cached_prefixes,
        "max_num_seqs": args.mix_max_num_seqs,
        "max_model_len": max_model_len,
    }
    runs: dict[str, GenerateRun] = {}
    for schedule in ("prefix", "fcfs"):
        llm = load_llm(
            args.model,
            f"schedule={schedule}",
            block_size=bs,
            kv_cache_memory=pool_tokens * bytes_per_token,
            max_model_len=max_model_len,
            max_num_seqs=args.mix_max_num_seqs,
            prefix_caching=True,
            schedule=schedule,
        )
        run = timed_generate(llm, workload.prompts, workload.params(), f"schedule={schedule}")
        runs[schedule] = run
        log(f"schedule={schedule}: {run.wall_s:.1f} s, hit rate "
            f"{run.stats['prefix_hit_rate']:.0%}")  # fmt: skip
        del llm
        gc.collect()
    return runs, pool


# --- report ------------------------------------------------------------------------------------


def cache_section(workload: Workload, runs: dict[str, GenerateRun]) -> tuple[str, dict[str, Any]]:
    on, off = runs["cache on"], runs["cache off"]
    saved = 1 - on.stats["prefill_tokens_computed"] / max(off.stats["prefill_tokens_computed"], 1)
    speedup = off.wall_s / on.wall_s
    same = same_outputs(on, off)
    headers = [
        "prefix cache", "requests", "prompt tokens", "prefill computed", "prefill saved",
        "hit rate", "elapsed s", "speedup", "TTFT p50 s", "preemptions", "same greedy",
    ]  # fmt: skip
    rows = []
    for label, run in (("off", off), ("on", on)):
        s = run.stats
        rows.append([
            label, len(workload.prompts), s["prompt_tokens"], s["prefill_tokens_computed"],
            pct(saved) if run is on else "-", pct(s["prefix_hit_rate"]), run.wall_s,
            f"{speedup:.2f}x" if run is on else "1.00x", fmt(s["ttft_s"]["p50"], 2),
            s["preemptions"], f"{same[0]}/{same[1]}" if run is on else "-",
        ])  # fmt: skip
    summary = workload.summary()
    lines = [
        f"Workload: {workload.description}. Prompt tokens {workload.prompt_tokens:,}, shared "
        f"prefix {summary['shared_prefix_tokens']} tokens (longest common prefix of all prompts).",
        "",
        markdown_table(headers, rows),
    ]
    result = {
        "workload": summary,
        "prefill_saved": saved,
        "speedup": speedup,
        "same_greedy": list(same),
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


def verdicts(result: dict[str, Any]) -> str:
    saved_ok = result["prefill_saved"] >= TARGET_PREFILL_SAVED
    speed_ok = result["speedup"] >= TARGET_SPEEDUP
    return (
        f"Targets: prefill saved >= {TARGET_PREFILL_SAVED:.0%}: {pct(result['prefill_saved'])}, "
        f"{'met' if saved_ok else 'NOT met'}; end-to-end >= {TARGET_SPEEDUP}x: "
        f"{result['speedup']:.2f}x, {'met' if speed_ok else 'NOT met'}."
    )


def schedule_section(
    workload: Workload, runs: dict[str, GenerateRun], pool: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    prefix, fcfs = runs["prefix"], runs["fcfs"]
    headers = [
        "schedule", "prefill computed", "hit rate", "elapsed s", "vs prefix", "preemptions",
        "peak running", "TTFT p50 s", "same greedy",
    ]  # fmt: skip
    same = same_outputs(prefix, fcfs)
    rows = []
    for name, run in runs.items():
        s = run.stats
        rows.append([
            name, s["prefill_tokens_computed"], pct(s["prefix_hit_rate"]), run.wall_s,
            f"{run.wall_s / prefix.wall_s:.2f}x", s["preemptions"], s["peak_running"],
            fmt(s["ttft_s"]["p50"], 2), f"{same[0]}/{same[1]}" if run is fcfs else "-",
        ])  # fmt: skip
    num_docs = len(set(workload.groups))
    prefill = [r.stats["prefill_tokens_computed"] for r in (fcfs, prefix)]
    prefill_ratio = prefill[0] / max(prefill[1], 1)
    lines = [
        f"Workload: {workload.description}; each document's requests share "
        f"{pool['shared_tokens_per_prefix']} tokens. KV pool {pool['pool_tokens']:,} tokens "
        f"({pool['pool_blocks']} blocks): room for {pool['cached_prefixes']} of the "
        f"{num_docs} documents plus max_num_seqs={pool['max_num_seqs']} running sequences' own "
        "tokens. Prefix cache on, eviction lru.",
        "",
        markdown_table(headers, rows),
        "",
        f"fcfs computes {prefill_ratio:.2f}x the prefill tokens of schedule=prefix and takes "
        f"{fcfs.wall_s / prefix.wall_s:.2f}x its time.",
    ]
    result = {
        "workload": workload.summary(),
        "pool": pool,
        "same_greedy": list(same),
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


# --- main --------------------------------------------------------------------------------------

SECTIONS = ("system", "fewshot", "schedule")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g = p.add_argument_group("system: shared system prompt")
    g.add_argument("--system-requests", type=int, default=48)
    g.add_argument("--system-tokens", type=int, default=600, help="system prompt length")
    g.add_argument("--question-tokens", type=int, default=48, help="max tokens of a question")
    g.add_argument("--system-max-tokens", type=int, default=24, help="output tokens per request")
    g = p.add_argument_group("fewshot: k-shot HumanEval")
    g.add_argument("--shots", type=int, default=5)
    g.add_argument("--fewshot-requests", type=int, default=32)
    g.add_argument("--max-shot-tokens", type=int, default=160, help="cap per solved example")
    g.add_argument("--max-question-tokens", type=int, default=160, help="cap per problem")
    g.add_argument("--fewshot-max-tokens", type=int, default=24, help="output tokens per request")
    g = p.add_argument_group("schedule: prefix vs fcfs on a mix of shared prefixes")
    g.add_argument("--mix-prefixes", type=int, default=6, help="distinct shared documents")
    g.add_argument("--mix-requests-per-prefix", type=int, default=6)
    g.add_argument("--mix-prefix-tokens", type=int, default=256, help="tokens per document")
    g.add_argument("--mix-cached-prefixes", type=int, default=3, help="documents the pool holds")
    g.add_argument("--mix-max-num-seqs", type=int, default=8)
    g.add_argument("--mix-max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny run (< 1 min) to check it works")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if args.smoke:
        args.system_requests, args.system_tokens, args.system_max_tokens = 4, 64, 4
        args.question_tokens = 24
        args.shots, args.fewshot_requests, args.fewshot_max_tokens = 1, 3, 4
        args.max_shot_tokens, args.max_question_tokens = 80, 60
        args.mix_prefixes, args.mix_requests_per_prefix, args.mix_prefix_tokens = 3, 2, 48
        args.mix_cached_prefixes, args.mix_max_num_seqs, args.mix_max_tokens = 1, 2, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    cfg = resolve_model_source(args.model).config
    bytes_per_token = bytes_per_block(
        cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32
    )
    # The tokenizer alone builds the workloads; engines load per configuration below.
    tokenizer = load_tokenizer(args.model)
    mix_n = args.mix_prefixes * args.mix_requests_per_prefix
    questions = short_sharegpt_questions(
        tokenizer, args.system_requests + mix_n, args.seed, args.question_tokens
    )
    env = environment()
    report: list[str] = [
        f"## Prefix sharing: radix prefix cache and prefix-aware scheduling ({env['date_utc']})",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model {args.model}, float32, block size {args.block_size}, {env['torch_threads']} torch "
        f"threads, CPU {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}. Greedy, "
        "ignore_eos; times are wall clock around one generate call after a warm-up.",
    ]
    results: dict[str, Any] = {}

    cache_workloads: list[Workload] = []
    if "system" in sections:
        cache_workloads.append(
            system_prompt_workload(
                tokenizer,
                questions[: args.system_requests],
                args.system_tokens,
                args.system_max_tokens,
            )
        )
    if "fewshot" in sections:
        cache_workloads.append(
            few_shot_workload(
                tokenizer,
                args.shots,
                args.fewshot_requests,
                args.seed,
                args.max_shot_tokens,
                args.max_question_tokens,
                args.fewshot_max_tokens,
            )
        )
    if cache_workloads:
        runs = run_cache_on_off(args, cache_workloads, bytes_per_token)
        titles = {"system": "Shared system prompt", "fewshot": f"{args.shots}-shot prompt"}
        for w in cache_workloads:
            text, result = cache_section(w, runs[w.name])
            report += ["", f"### {titles[w.name]}: prefix cache on vs off", "", text, ""]
            if w.name == "system":
                report.append(verdicts(result))
            results[w.name] = result
    if "schedule" in sections:
        workload = mixed_prefix_workload(
            tokenizer, questions[args.system_requests :], args.mix_prefixes,
            args.mix_prefix_tokens, args.seed, args.mix_max_tokens,
        )  # fmt: skip
        runs_by_schedule, pool = run_schedules(args, workload, bytes_per_token)
        text, result = schedule_section(workload, runs_by_schedule, pool)
        report += ["", "### schedule=prefix vs fcfs on a shuffled mix of shared prefixes", ""]
        report.append(text)
        results["schedule"] = result

    print("\n".join(report))
    if args.out:
        write_json(
            args.out,
            {
                "command": command_line(),
                "args": args_json(args),
                "environment": env,
                "targets": {"prefill_saved": TARGET_PREFILL_SAVED, "speedup": TARGET_SPEEDUP},
                **results,
            },
        )
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
