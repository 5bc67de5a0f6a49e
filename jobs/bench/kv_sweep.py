"""The seed's benchmark scaled to this machine: paged against static KV at the same memory,
over pool sizes from tight to ample, on ShareGPT first turns generating their real reply
lengths, both known to the engine (ignore_eos, max_tokens = the reply) and not (max_tokens = a
cap, the model's own EOS ends the reply). Each run records what the simulator needs to replay
it (requests, their output lengths, the engine's settings and pool) beside its figures; with
--calibrate, fixed-batch runs on random prompts that jobs/bench/simulated.py fits a step-cost
model to.

    python -m jobs.bench.kv_sweep --requests 96 --pools 8,16,32 \
        --out jobs/bench/results/kv_sweep.json
    python -m jobs.bench.kv_sweep --calibrate --out jobs/bench/results/sim_calibration.json

A pool of k holds k static sequences: k * max_model_len token slots of K/V.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from batchpage import LLM, SamplingParams
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.engine_runs import load_llm, log
from jobs.bench.report import environment, fmt, markdown_table, save_results
from jobs.bench.workloads import sharegpt_workload


def kv_bytes_per_token(model: str, dtype_bytes: int) -> int:
    cfg = resolve_model_source(model).config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def one_run(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool, tag: str
) -> dict[str, Any]:
    """One generate call: its figures and what a replay needs."""
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    stats = llm.stats
    prompt_tokens = sum(len(p) for p in prompts)
    first = prompt_tokens - stats["cached_prompt_tokens"]
    return {
        "tag": tag,
        "ignore_eos": ignore_eos,
        "engine": {k: getattr(llm.config, k) for k in ENGINE_KEYS},
        "num_blocks": llm.plan.num_blocks,
        "max_model_len": llm.plan.max_model_len,
        "max_num_batched_tokens": llm.config.batched_tokens(llm.plan.device),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "output_lens": [len(o.outputs[0].token_ids) for o in outs],
        "wall_s": stats["elapsed_s"],
        "output_tokens_per_s": stats["output_tokens_per_s"],
        "generated_tokens": stats["generated_tokens"],
        "steps": stats["steps"],
        "peak_running": stats["peak_running"],
        "preemptions": stats["preemptions"],
        "recomputed_tokens": stats["prefill_tokens_computed"] - first,
        "kv_waste": stats["kv_waste"],
    }


ENGINE_KEYS = (
    "block_size", "max_num_seqs", "kv_allocator", "prefix_caching", "preemption_mode",
    "schedule", "enable_chunked_prefill", "eviction_policy", "dtype",
)  # fmt: skip


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(resolve_model_source(args.model))
    work = sharegpt_workload(
        tokenizer, args.requests, args.seed, args.max_prompt_tokens, args.max_output_tokens
    )
    per_token = kv_bytes_per_token(args.model, 4 if args.dtype == "float32" else 2)
    runs = []
    for pool in args.pools:
        memory = pool * args.max_model_len * per_token
        for mode in args.modes:
            known = mode == "ignore_eos"
            budgets = work.max_tokens if known else [args.max_output_tokens] * args.requests
            for allocator in ("paged", "static"):
                llm = load_llm(
                    args.model, f"{allocator} pool={pool}", dtype=args.dtype,
                    max_model_len=args.max_model_len, kv_cache_memory=memory,
                    kv_allocator=allocator, max_num_seqs=args.max_num_seqs,
                )  # fmt: skip
                run = one_run(llm, work.prompts, budgets, known, f"pool={pool} {mode}")
                run["pool_sequences"] = pool
                run["kv_cache_memory"] = memory
                runs.append(run)
                log(f"{allocator} pool={pool} {mode}: {run['output_tokens_per_s']:.1f} tok/s, "
                    f"peak {run['peak_running']}, {run['preemptions']} preemptions")  # fmt: skip
                del llm
    return runs


def calibrate(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fixed batches on an ample pool: random prompts, every request the same length."""
    vocab = resolve_model_source(args.model).config.vocab_size
    rng = random.Random(args.seed)
    runs = []
    llm = load_llm(args.model, "calibration", dtype=args.dtype, max_model_len=args.max_model_len)
    for batch, prompt_len, out_len in CALIBRATION:
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
        run = one_run(llm, prompts, [out_len] * batch, True, f"B={batch} P={prompt_len}")
        runs.append(run)
        log(f"calibration {run['tag']}: {run['wall_s']:.2f} s, {run['steps']} steps")
    return runs


# (sequences, prompt tokens, output tokens): decode-heavy at several batch sizes, and prefill.
CALIBRATION = [(1, 64, 64), (4, 64, 64), (16, 64, 64), (64, 64, 32), (4, 960, 4), (32, 256, 16)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-output-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["ignore_eos", "eos"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    env = environment()
    runs = calibrate(args) if args.calibrate else sweep(args)
    headers = ["run", "allocator", "tok/s", "peak running", "preemptions", "recomputed", "KV waste"]
    rows = [
        [r["tag"], r["engine"]["kv_allocator"], fmt(r["output_tokens_per_s"]), r["peak_running"],
         r["preemptions"], r["recomputed_tokens"], f"{100 * r['kv_waste']:.1f}%"]
        for r in runs
    ]  # fmt: skip
    print(markdown_table(headers, rows))
    save_results(args.out, env, runs, args)


if __name__ == "__main__":
    main()
