"""End-to-end throughput on this CPU: batchpage against HF transformers with static batches.

    python -m jobs.bench.throughput --out bench/throughput.json    # the real measurement
    python -m jobs.bench.throughput --smoke                        # < 1 minute: does it run?

Workload: ShareGPT V3 first-turn prompts (a seeded random sample, through the model's chat
template), each generating exactly its real reply's token length (capped; ignore_eos), so both
systems produce the same tokens. "Useful" tokens are those target lengths.

- batchpage: one `generate` over the whole workload (paged KV, continuous batching), with the
  prefix cache on and, for attribution, off.
- HF transformers `generate`, the pre-PagedAttention way: static batches of B requests in
  workload order, left-padded to the batch's longest prompt, each batch running until its
  longest request is done (min_new_tokens = max_new_tokens, so EOS cannot end it early). Padding
  and the shorter requests' overrun are computed but not useful. Every B is measured; "HF best"
  is the best useful tok/s over B. A per-B time budget may cut the measured set short: the
  table's "timed" column says how many requests each row covers.
- Same model weights (transformers dequantizes the same GGUF), dtype float32, token ids, threads.
- The machine's ceiling: the model's linear shapes timed on this CPU give a matmul-bound
  tokens/s; the engine is reported as a fraction of it.

Prints Markdown tables (for BENCHMARKS.md) and the exact command; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchpage import LLM
from batchpage.model.loader import ModelSource, resolve_model_source
from jobs.bench.ceiling import Ceiling, measure_matmul_ceiling, model_flops_per_token
from jobs.bench.engine_runs import WARM_UP_TEXTS, load_llm, run_workload
from jobs.bench.report import (
    args_json,
    command_line,
    environment,
    fmt,
    log,
    markdown_table,
    timed,
    write_json,
)
from jobs.bench.workloads import WorkloadRequest, sample_sharegpt, workload_summary

TARGET_SPEEDUP = 3.0


@dataclass
class Result:
    """One measured configuration. Token counts cover only the requests that were timed."""

    system: str
    batch_size: str
    requests: int
    elapsed_s: float
    useful_tokens: int  # sum of target output lengths
    prompt_tokens: int  # real prompt tokens (no padding)
    computed_slots: int | None = None  # HF: batch x (padded prompt + max new) token slots
    greedy_match: tuple[int, int] | None = None  # (equal, compared) against batchpage
    extra: dict[str, Any] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict, repr=False)  # index -> tokens

    @property
    def useful_tok_s(self) -> float:
        return self.useful_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.useful_tokens + self.prompt_tokens) / self.elapsed_s

    @property
    def wasted(self) -> float | None:
        """Share of HF's computed token slots that were padding or overrun."""
        if not self.computed_slots:
            return None
        return 1.0 - (self.useful_tokens + self.prompt_tokens) / self.computed_slots

    def as_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "batch_size": self.batch_size,
            "requests": self.requests,
            "elapsed_s": self.elapsed_s,
            "useful_tokens": self.useful_tokens,
            "prompt_tokens": self.prompt_tokens,
            "useful_tok_s": self.useful_tok_s,
            "total_tok_s": self.total_tok_s,
            "wasted_fraction": self.wasted,
            "greedy_match": list(self.greedy_match) if self.greedy_match else None,
            **self.extra,
        }


# --- batchpage ---------------------------------------------------------------------------------


def engine_args(args: argparse.Namespace, prefix_caching: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "block_size": args.block_size,
        "max_model_len": args.max_prompt_tokens + args.max_output_tokens,
        "prefix_caching": prefix_caching,
        "attention_backend": args.attention_backend,
    }
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    return kwargs


def run_batchpage(llm: LLM, requests: list[WorkloadRequest], label: str) -> Result:
    # Wall clock around the whole generate call, as for HF (the engine's own elapsed_s, in
    # engine_stats, covers only its step loop).
    run = run_workload(llm, requests, label)
    # Token sums from the workload, not the engine's counters: both systems are scored alike.
    return Result(
        system=label,
        batch_size=f"continuous (max {llm.config.max_num_seqs})",
        requests=len(requests),
        elapsed_s=run.wall_s,
        useful_tokens=sum(r.output_len for r in requests),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        extra={
            "engine_stats": run.stats,
            "attention": type(llm.engine.runner.attention).__name__,
        },
        outputs={i: samples[0] for i, samples in enumerate(run.outputs)},
    )


# --- HF transformers, static batches -----------------------------------------------------------


def load_hf_model(source: ModelSource) -> Any:
    from transformers import AutoModelForCausalLM

    if source.kind == "gguf":  # transformers dequantizes the same file to float32
        model = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return model.eval()


def hf_generate_batch(
    model: Any, batch: list[WorkloadRequest], pad_id: int
) -> tuple[torch.Tensor, int, int]:
    """Left-pad to the longest prompt and run until the longest target: (output ids, padded
    prompt length, new tokens)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    new = max(r.output_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,  # suppresses EOS: the batch generates exactly `new` tokens
            do_sample=False,
            pad_token_id=pad_id,
        )
    if out.shape[1] != width + new:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new}")
    return out, width, new


def run_hf_static(
    model: Any,
    requests: list[WorkloadRequest],
    batch_size: int,
    pad_id: int,
    time_budget_s: float | None,
) -> Result:
    result = Result("HF transformers (static)", str(batch_size), 0, 0.0, 0, 0, computed_slots=0)
    for start in range(0, len(requests), batch_size):
        if time_budget_s and result.elapsed_s >= time_budget_s:
            break  # at least one batch always runs
        batch = requests[start : start + batch_size]
        (out, width, new), seconds = timed(lambda b=batch: hf_generate_batch(model, b, pad_id))
        result.elapsed_s += seconds
        result.requests += len(batch)
        result.useful_tokens += sum(r.output_len for r in batch)
        result.prompt_tokens += sum(len(r.prompt_token_ids) for r in batch)
        result.computed_slots = (result.computed_slots or 0) + len(batch) * (width + new)
        for row, r in enumerate(batch):
            result.outputs[start + row] = out[row, width : width + r.output_len].tolist()
    return result


def greedy_match(ref: Result, other: Result) -> tuple[int, int]:
    """How many of other's requests produced exactly the reference's greedy tokens. A mismatch
    is not an error: batched float32 can flip a near-tie, after which the texts diverge."""
    common = [i for i in other.outputs if i in ref.outputs]
    return sum(ref.outputs[i] == other.outputs[i] for i in common), len(common)


# --- report ------------------------------------------------------------------------------------


def results_table(results: list[Result], hf_best: Result | None) -> str:
    headers = [
        "system", "batch size", "timed", "elapsed s", "useful tok/s", "total tok/s",
        "padding+overrun", "same greedy tokens", "vs HF best",
    ]  # fmt: skip
    rows = []
    for r in results:
        rows.append([
            r.system, r.batch_size, r.requests, r.elapsed_s, r.useful_tok_s, r.total_tok_s,
            f"{r.wasted:.0%}" if r.wasted is not None else None,
            f"{r.greedy_match[0]}/{r.greedy_match[1]}" if r.greedy_match else None,
            f"{r.useful_tok_s / hf_best.useful_tok_s:.2f}x" if hf_best else None,
        ])  # fmt: skip
    return markdown_table(headers, rows)


def ceiling_section(
    ceiling: Ceiling,
    matmul_rows: list[dict[str, Any]],
    cfg: Any,
    requests: list[WorkloadRequest],
    engine: Result,
) -> tuple[str, dict[str, Any]]:
    token_counts = sorted({row["tokens"] for row in matmul_rows})
    shapes = list(dict.fromkeys((row["shape"], row["in"], row["out"]) for row in matmul_rows))
    rate = {(row["shape"], row["tokens"]): row["gflops"] for row in matmul_rows}
    table = markdown_table(
        ["linear", "in x out", *(f"GFLOP/s @ M={m}" for m in token_counts)],
        [[name, f"{i} x {o}", *(rate[name, m] for m in token_counts)] for name, i, o in shapes],
    )
    summary = workload_summary(requests)
    mean_context = summary["prompt_tokens_mean"] + summary["output_tokens_mean"] / 2
    workload_bound = summary["output_tokens"] / ceiling.workload_seconds(requests)
    decode_bound = ceiling.decode_tokens_per_s(mean_context)
    info = {
        "flops_per_generated_token": model_flops_per_token(cfg, with_logits=True),
        "flops_per_prompt_token": model_flops_per_token(cfg, with_logits=False),
        "mean_context": mean_context,
        "decode_bound_tok_s": decode_bound,
        "workload_bound_useful_tok_s": workload_bound,
        "engine_fraction_of_workload_bound": engine.useful_tok_s / workload_bound,
        "engine_fraction_of_decode_bound": engine.useful_tok_s / decode_bound,
        "matmul": matmul_rows,
    }
    text = "\n".join([
        table,
        "",
        f"- FLOPs per generated token (linears + lm_head): "
        f"{info['flops_per_generated_token'] / 1e6:,.0f} M; per prompt token: "
        f"{info['flops_per_prompt_token'] / 1e6:,.0f} M; attention at mean context "
        f"{mean_context:,.0f}: {ceiling.attn_flops_per_key * mean_context / 1e6:,.1f} M",
        f"- Large-batch decode bound (best GFLOP/s per shape): {decode_bound:,.1f} tok/s; "
        f"{engine.system} reaches {info['engine_fraction_of_decode_bound']:.1%} of it",
        f"- Whole-workload bound (prefill + decode + attention, useful tok/s): "
        f"{workload_bound:,.1f}; {engine.system} reaches "
        f"{info['engine_fraction_of_workload_bound']:.1%} of it (the bound computes every prompt "
        "token; a prefix cache may skip some)",
    ])  # fmt: skip
    return text, info


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts: skipped")
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--min-output-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,4,8,16,32,64", help="HF static batch sizes")
    p.add_argument(
        "--hf-time-budget", type=float, default=150.0,
        help="seconds per HF batch size; stop after the batch that crosses it (0: no limit)",
    )  # fmt: skip
    p.add_argument("--skip-hf", action="store_true", help="engine and ceiling only")
    p.add_argument(
        "--prefix-caching", choices=("on", "off", "both"), default="both",
        help="batchpage runs: with the prefix cache, without it, or both (for attribution)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--attention-backend", choices=("auto", "torch", "cpu"), default="auto",
        help="batchpage's attention (auto: the C++ decode kernel on CPU)",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="bytes or fraction")
    p.add_argument("--ceiling-tokens", default="256,512,1024", help="matmul M values to time")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny run (< 1 min) to check it works")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.max_prompt_tokens, args.max_output_tokens = 4, 64, 8
        args.batch_sizes, args.ceiling_tokens, args.hf_time_budget = "1,2", "64", 0.0
    return args


def run_engines(
    args: argparse.Namespace,
) -> tuple[list[WorkloadRequest], list[WorkloadRequest], int, list[Result]]:
    """Sample the workload with the engine's tokenizer, then time each batchpage variant.
    Returns (workload, warm-up requests, pad id for HF, results); results[0] is the reference."""
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    results: list[Result] = []
    requests: list[WorkloadRequest] = []
    warm_up: list[WorkloadRequest] = []
    pad_id = 0
    for prefix_caching in variants:
        label = "batchpage" + ("" if prefix_caching else " (no prefix cache)")
        llm = load_llm(args.model, label, **engine_args(args, prefix_caching))
        if not requests:  # the same token ids for every system
            requests = sample_sharegpt(
                llm.tokenizer, args.num_requests, args.seed, args.max_prompt_tokens,
                args.max_output_tokens, args.min_output_tokens,
            )  # fmt: skip
            # Left padding is masked out, so any id works; prefer the tokenizer's own.
            candidates = [llm.tokenizer.pad_token_id, *sorted(llm.tokenizer.eos_token_ids), 0]
            pad_id = next(i for i in candidates if i is not None)
            # HF warms up on the engine's warm-up requests.
            warm_up = [
                WorkloadRequest(f"warm-up-{i}", llm.tokenizer.encode(text), 2, 2)
                for i, text in enumerate(WARM_UP_TEXTS)
            ]
        results.append(run_batchpage(llm, requests, label))
        del llm
        gc.collect()  # free the KV pool before the next system allocates its own
    for r in results[1:]:
        r.greedy_match = greedy_match(results[0], r)
    return requests, warm_up, pad_id, results


def run_hf(
    args: argparse.Namespace,
    source: ModelSource,
    requests: list[WorkloadRequest],
    warm_up: list[WorkloadRequest],
    pad_id: int,
    reference: Result,
) -> list[Result]:
    model, seconds = timed(lambda: load_hf_model(source))
    log(f"HF transformers loaded in {seconds:.1f} s")
    hf_generate_batch(model, warm_up, pad_id)  # the same warm-up as the engine's
    results = []
    for b in (int(b) for b in args.batch_sizes.split(",")):
        result = run_hf_static(model, requests, b, pad_id, args.hf_time_budget or None)
        result.greedy_match = greedy_match(reference, result)
        results.append(result)
        log(f"HF B={b}: {result.useful_tok_s:,.1f} useful tok/s over {result.requests} requests")
    return results


def print_report(
    args: argparse.Namespace,
    cfg: Any,
    env: dict[str, Any],
    requests: list[WorkloadRequest],
    results: list[Result],
    hf_best: Result | None,
    ceiling_text: str,
) -> None:
    summary = workload_summary(requests)
    reference = results[0]
    print(f"## Throughput: batchpage vs HF transformers static batching ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(
        f"Model {args.model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}), float32, "
        f"{env['torch_threads']} torch threads, CPU {env['cpu']} ({env['cpu_count']} cores), "
        f"torch {env['torch']}, transformers {env['transformers']}.\n"
    )
    print(
        f"Workload: {summary['requests']} ShareGPT first turns (seed {args.seed}, chat "
        f"template, prompts <= {args.max_prompt_tokens} tokens), prompt tokens mean "
        f"{summary['prompt_tokens_mean']:.0f} / max {summary['prompt_tokens_max']}, output "
        f"tokens = real reply length clamped to [{args.min_output_tokens}, "
        f"{args.max_output_tokens}]: mean {summary['output_tokens_mean']:.0f}, total "
        f"{summary['output_tokens']}.\n"
    )
    print(results_table(results, hf_best))
    if hf_best is not None:
        speedup = reference.useful_tok_s / hf_best.useful_tok_s
        verdict = "met" if speedup >= TARGET_SPEEDUP else "NOT met"
        print(
            f"\n{reference.system}: {speedup:.2f}x HF's best static batch (B={hf_best.batch_size})"
            f" in useful tok/s; target >= {TARGET_SPEEDUP:.0f}x: {verdict}."
        )
    stats = reference.extra["engine_stats"]
    print(
        f"\nEngine: attention {reference.extra['attention']}, "
        f"peak_running {stats.get('peak_running')}, steps {stats.get('steps')}, "
        f"preemptions {stats.get('preemptions')}, kv_utilization "
        f"{fmt(stats.get('kv_utilization'), 2)}, prefix_hit_rate "
        f"{fmt(stats.get('prefix_hit_rate'), 2)}.\n"
    )
    print(f"### Machine ceiling (float32 matmul, best of repeated calls)\n\n{ceiling_text}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Pin the count explicitly so that every measurement below (ceiling, engine, HF) uses it.
    torch.set_num_threads(torch.get_num_threads())
    source = resolve_model_source(args.model)
    cfg = source.config

    # The ceiling first, while nothing else of ours holds memory or caches.
    ceiling_tokens = [int(m) for m in args.ceiling_tokens.split(",")]
    min_time = 0.05 if args.smoke else 0.3
    ceiling, matmul_rows = measure_matmul_ceiling(cfg, ceiling_tokens, torch.float32, min_time)
    log("matmul ceiling measured")

    requests, warm_up, pad_id, results = run_engines(args)
    reference = results[0]
    if not args.skip_hf:
        results += run_hf(args, source, requests, warm_up, pad_id, reference)
    hf = [r for r in results if r.system.startswith("HF")]
    hf_best = max(hf, key=lambda r: r.useful_tok_s, default=None)

    env = environment()
    ceiling_text, ceiling_info = ceiling_section(ceiling, matmul_rows, cfg, requests, reference)
    print_report(args, cfg, env, requests, results, hf_best, ceiling_text)
    if args.out:
        write_json(
            args.out,
            {
                "command": command_line(),
                "args": args_json(args),
                "environment": env,
                "workload": workload_summary(requests),
                "results": [r.as_json() for r in results],
                "hf_best": hf_best.as_json() if hf_best else None,
                "speedup_vs_hf_best": reference.useful_tok_s / hf_best.useful_tok_s
                if hf_best
                else None,
                "target_speedup": TARGET_SPEEDUP,
                "ceiling": ceiling_info,
            },
        )
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
