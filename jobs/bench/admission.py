"""Admission by expected growth against admission on the prompt alone: preemptions, throughput.

    python -m jobs.bench.admission                 # the measurement (a few minutes on 2 cores)
    python -m jobs.bench.admission --smoke         # < 1 minute: does it run?

The same engine runs each workload three times per round, in turn: with the scheduler's
GrowthEstimate removed, so a sequence is admitted as soon as its prompt fits (what the engine
did first); with the estimate reserving certain growth (ignore_eos, min_tokens) in full (its
first version); and with the default estimate (engine/admission.py), which overcommits certain
growth by up to 2x. Workloads, ShareGPT V3 first
turns through the chat template, greedy:
- tight: --requests short requests, max_model_len --max-model-len, a pool of --pool-seqs
  max_model_len sequences, each generating its real reply's length (ignore_eos);
- natural: the same prompts and pool, max_tokens --natural-max-tokens without ignore_eos, so
  rows stop at EOS and the output budget overstates what they need;
- sharegpt: --sharegpt-requests requests at the default pool (the throughput benchmark's size).
Throughput is generated tokens over the wall time of the generate call, best of --rounds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from batchpage import LLM, SamplingParams
from batchpage.cache.kv_cache import bytes_per_block
from batchpage.cpu_info import cpu_model
from batchpage.engine.admission import GrowthEstimate
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.engine_runs import GenerateRun, load_llm, same_outputs, timed_generate
from jobs.bench.report import command_line, log, markdown_table, write_json
from jobs.bench.workloads import WorkloadRequest, sample_sharegpt

# Admission on the prompt alone; by expected growth with certain growth (ignore_eos, min_tokens)
# reserved in full; by expected growth with it overcommitted by up to 2x (the default).
MODES = ("on prompt fit", "growth, certain reserved", "by expected growth")
GROWTH = {MODES[1]: dict(certain_floor=1.0), MODES[2]: {}}


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    params: list[SamplingParams]
    engine: dict[str, Any]


def workloads(args: argparse.Namespace, tokenizer: Any, bytes_per_token: int) -> list[Workload]:
    short = sample_sharegpt(
        tokenizer,
        args.requests,
        seed=args.seed,
        max_prompt_tokens=args.max_model_len // 2,
        max_output_tokens=args.max_model_len // 4,
    )
    tight = {
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.pool_seqs * args.max_model_len * bytes_per_token,
        "prefix_caching": False,
    }
    exact = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in short]
    natural = [SamplingParams(temperature=0, max_tokens=args.natural_max_tokens)] * len(short)
    big = sample_sharegpt(tokenizer, args.sharegpt_requests, seed=args.seed)
    big_params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in big
    ]
    return [
        Workload("tight", short, exact, tight),
        Workload("natural", short, natural, tight),
        Workload("sharegpt", big, big_params, {"prefix_caching": False}),
    ]


def run_mode(llm: LLM, w: Workload, mode: str) -> GenerateRun:
    scheduler = llm.engine.scheduler
    scheduler.growth = GrowthEstimate(**GROWTH[mode]) if mode in GROWTH else None
    prompts = [r.prompt_token_ids for r in w.requests]
    run = timed_generate(llm, prompts, w.params, f"{w.name}/{mode}")
    stats = run.stats
    log(f"{w.name} / {mode}: {run.wall_s:.1f} s, {run.generated_tok_s:.1f} tok/s, "
        f"{stats['preemptions']} preemptions, peak running {stats['peak_running']}")  # fmt: skip
    return run


def measure(args: argparse.Namespace, w: Workload) -> dict[str, GenerateRun]:
    llm = load_llm(args.model, w.name, **w.engine)
    best: dict[str, GenerateRun] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            run = run_mode(llm, w, mode)
            if mode not in best or run.wall_s < best[mode].wall_s:
                best[mode] = run
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=384)
    p.add_argument("--pool-seqs", type=int, default=6)
    p.add_argument("--natural-max-tokens", type=int, default=96)
    p.add_argument("--sharegpt-requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default="tight,natural,sharegpt")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--out", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.sharegpt_requests, args.rounds = 8, 8, 1
        args.max_model_len, args.pool_seqs = 192, 2

    cfg = resolve_model_source(args.model).config
    per_token = bytes_per_block(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    chosen = set(args.workloads.split(","))
    rows, record = [], {}
    for w in workloads(args, load_tokenizer(args.model), per_token):
        if w.name not in chosen:
            continue
        runs = measure(args, w)
        before = runs[MODES[0]]
        for mode in MODES:
            run = runs[mode]
            same, total = same_outputs(before, run)
            speedup = run.generated_tok_s / before.generated_tok_s
            rows.append([
                w.name, len(w.requests), mode, run.stats["preemptions"],
                f"{run.generated_tok_s:.1f}", f"{speedup:.2f}x",
                run.stats["peak_running"], f"{same}/{total}",
            ])  # fmt: skip
        record[w.name] = {m: runs[m].as_json() for m in MODES}
    headers = [
        "workload", "requests", "admission", "preemptions", "tok/s", "vs on prompt fit",
        "peak running", "same outputs",
    ]  # fmt: skip
    print(f"\n{command_line()}\nCPU: {cpu_model()}\n")
    print(markdown_table(headers, rows))
    if args.out:
        write_json(args.out, {"command": command_line(), "cpu": cpu_model(), "runs": record})


if __name__ == "__main__":
    main()
