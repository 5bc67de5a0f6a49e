"""KV cache allocation on this CPU: paged vs static, block sizes, and memory saved by sharing.

    python -m jobs.bench.kv --out bench/kv.json      # the real measurement
    python -m jobs.bench.kv --smoke                  # < 1 minute: does it run?

1. paged: kv_allocator=paged vs static (each sequence reserves max_model_len slots at admission
   and holds them until it finishes, as before PagedAttention) on the same KV memory: a pool of
   --pool-seqs x max_model_len tokens. Workload: ShareGPT V3 first turns (seeded sample, chat
   template), each generating its real reply's length (capped; greedy, ignore_eos), so both
   allocators produce the same tokens. The prefix cache is off for both: static cannot share, so
   the comparison is the allocation alone.
2. sweep: the paged allocator at block sizes 4..256 on the same KV memory (a smaller slice of the
   workload): waste, throughput.
3. sharing: one long prompt (about --share-prompt-tokens tokens), n=4 parallel samples forked
   from one prefill (blocks shared by reference count, copy-on-write of the partial block) and
   beam search of width 4, against 4 independent requests of the same prompt and lengths (no
   sharing; prefix cache off). Memory = the peak of KV blocks in use during the run.

kv_waste is the engine's time-averaged 1 - (slots holding K/V) / (slots reserved by running
sequences). Throughput is generated tokens over the wall time of the whole generate call.
Prints Markdown tables; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchpage import LLM, SamplingParams
from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.kv_manager import blocks_for
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.engine_runs import GenerateRun, load_llm, run_workload, same_outputs, timed_generate
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
from jobs.bench.workloads import (
    WorkloadRequest,
    sample_sharegpt,
    sharegpt_records,
    text_of_tokens,
    workload_summary,
)

TARGET_PAGED_WASTE = 0.04
TARGET_CONCURRENCY = 3.0
TARGET_THROUGHPUT = 1.5


@dataclass(frozen=True)
class Pool:
    """KV memory shared by every configuration of a section, in tokens and bytes."""

    tokens: int
    bytes_per_token: int

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


# --- 1. paged vs static ------------------------------------------------------------------------


def paged_vs_static(
    args: argparse.Namespace, requests: list[WorkloadRequest], pool: Pool, keep_paged: bool
) -> tuple[dict[str, GenerateRun], LLM | None]:
    """Both allocators on the same pool. Returns the runs and, with keep_paged, the paged engine
    (the sweep reuses it at the same block size instead of loading it again)."""
    runs: dict[str, GenerateRun] = {}
    kept: LLM | None = None
    for allocator in ("paged", "static"):
        llm = load_llm(
            args.model,
            allocator,
            prefix_caching=False,
            block_size=args.block_size,
            kv_cache_memory=pool.bytes,
            max_model_len=args.max_model_len,
            kv_allocator=allocator,
        )
        runs[allocator] = run_workload(llm, requests, allocator)
        if allocator == "paged" and keep_paged:
            kept = llm
        del llm
        gc.collect()  # free this pool before the next engine allocates its own
    return runs, kept


def paged_section(
    requests: list[WorkloadRequest], runs: dict[str, GenerateRun], pool: Pool, args: Any
) -> tuple[str, dict[str, Any]]:
    paged, static = runs["paged"], runs["static"]
    concurrency = paged.stats["peak_running"] / max(static.stats["peak_running"], 1)
    throughput = paged.generated_tok_s / static.generated_tok_s
    same = same_outputs(paged, static)
    headers = [
        "allocator", "elapsed s", "generated tok/s", "vs static", "peak running",
        "preemptions", "KV waste", "peak KV blocks", "steps", "TTFT p50 s", "same greedy",
    ]  # fmt: skip
    rows = []
    for name, run in runs.items():
        s = run.stats
        rows.append([
            name, run.wall_s, run.generated_tok_s,
            f"{run.generated_tok_s / static.generated_tok_s:.2f}x",
            s["peak_running"], s["preemptions"], pct(s["kv_waste"]),
            f"{s['peak_kv_blocks_used']}/{s['kv_blocks_total']}", s["steps"],
            fmt(s["ttft_s"]["p50"], 2), f"{same[0]}/{same[1]}" if run is paged else "-",
        ])  # fmt: skip
    w = workload_summary(requests)
    waste_ok = paged.stats["kv_waste"] < TARGET_PAGED_WASTE
    lines = [
        f"Workload: {w['requests']} ShareGPT first turns (seed {args.seed}, chat template, "
        f"prompts <= {args.max_prompt_tokens} tokens: mean {w['prompt_tokens_mean']:.0f}), "
        f"output = real reply length clamped to [{args.min_output_tokens}, "
        f"{args.max_output_tokens}]: mean {w['output_tokens_mean']:.0f}, total "
        f"{w['output_tokens']:,}. max_model_len {args.max_model_len}; KV pool "
        f"{pool.tokens:,} tokens ({pool.mib:,.0f} MiB, {args.pool_seqs} x max_model_len), block "
        f"size {args.block_size}, prefix cache off, preemption by recompute.",
        "",
        markdown_table(headers, rows),
        "",
        f"Targets: paged KV waste < {TARGET_PAGED_WASTE:.0%}: {pct(paged.stats['kv_waste'])}, "
        f"{'met' if waste_ok else 'NOT met'} (static: {pct(static.stats['kv_waste'])}); peak "
        f"concurrency >= {TARGET_CONCURRENCY:.0f}x: {concurrency:.2f}x, "
        f"{'met' if concurrency >= TARGET_CONCURRENCY else 'NOT met'}; throughput >= "
        f"{TARGET_THROUGHPUT}x: {throughput:.2f}x, "
        f"{'met' if throughput >= TARGET_THROUGHPUT else 'NOT met'}.",
    ]
    result = {
        "workload": w,
        "pool_tokens": pool.tokens,
        "pool_bytes": pool.bytes,
        "concurrency_ratio": concurrency,
        "throughput_ratio": throughput,
        "same_greedy": list(same),
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


# --- 2. block size sweep -----------------------------------------------------------------------


def block_size_sweep(
    args: argparse.Namespace, requests: list[WorkloadRequest], pool: Pool, reuse: LLM | None
) -> dict[int, GenerateRun]:
    """The paged allocator at each block size on the same KV memory (so fewer, larger blocks)."""
    runs: dict[int, GenerateRun] = {}
    for bs in (int(b) for b in args.block_sizes.split(",")):
        label = f"paged, block size {bs}"
        if reuse is not None and reuse.config.block_size == bs:
            # The same configuration as section 1's paged engine; dropped after use to free it.
            llm, reuse = reuse, None
        else:
            llm = load_llm(
                args.model, label, prefix_caching=False, block_size=bs,
                kv_cache_memory=pool.bytes, max_model_len=args.max_model_len,
            )  # fmt: skip
        runs[bs] = run_workload(llm, requests, label)
        del llm
        gc.collect()
    return runs


def sweep_section(
    requests: list[WorkloadRequest], runs: dict[int, GenerateRun], pool: Pool, args: Any
) -> tuple[str, dict[str, Any]]:
    best = max(r.generated_tok_s for r in runs.values())
    headers = [
        "block size", "blocks in pool", "KV waste", "generated tok/s", "vs best",
        "peak running", "preemptions", "elapsed s", "steps",
    ]  # fmt: skip
    rows = [
        [bs, r.stats["kv_blocks_total"], pct(r.stats["kv_waste"]), r.generated_tok_s,
         f"{r.generated_tok_s / best:.2f}", r.stats["peak_running"], r.stats["preemptions"],
         r.wall_s, r.stats["steps"]]
        for bs, r in runs.items()
    ]  # fmt: skip
    w = workload_summary(requests)
    lines = [
        f"Workload: the first {w['requests']} requests of section 1, outputs capped at "
        f"{args.sweep_max_output_tokens} tokens (mean {w['output_tokens_mean']:.0f}); KV pool "
        f"{pool.tokens:,} tokens ({pool.mib:,.0f} MiB) at every block size; prefix cache off.",
        "",
        markdown_table(headers, rows),
    ]
    result = {"workload": w, "runs": {str(bs): r.as_json() for bs, r in runs.items()}}
    return "\n".join(lines), result


# --- 3. memory saved by sharing ----------------------------------------------------------------


def long_prompt(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """A chat-templated request to summarize num_tokens tokens of ShareGPT replies."""
    text = ""
    for _, _, reply in sharegpt_records(seed):
        text += reply.strip() + "\n\n"
        if len(tokenizer.encode(text, add_special_tokens=False)) >= num_tokens:
            break
    body = text_of_tokens(tokenizer, text, num_tokens)
    message = "Summarize the key points of the text below.\n\n" + body
    return tokenizer.apply_chat_template([{"role": "user", "content": message}])


def beam_problem(run: GenerateRun, width: int) -> str | None:
    """Why a beam-search run is not one (None if it looks right): an engine that ignores
    use_beam_search returns `width` identical greedy samples instead of distinct beams."""
    beams = run.outputs[0]
    if len(beams) != width:
        return f"expected {width} beams, got {len(beams)} sequences"
    if len({tuple(b) for b in beams}) < width:
        return "the returned sequences are not distinct beams: use_beam_search looks ignored"
    return None


def sharing(
    args: argparse.Namespace, prompt: list[int], bytes_per_token: int
) -> tuple[dict[str, GenerateRun], str | None, Pool, int]:
    """Returns the runs by name, why beam search was skipped (or None), the pool, and
    max_model_len."""
    n, out, bs = args.share_n, args.share_output_tokens, args.block_size
    max_model_len = bs * blocks_for(len(prompt) + out + 1, bs)
    # Room for n whole sequences at once (the no-sharing baseline must never preempt, or its
    # peak would be the pool's size) plus slack for beam candidates.
    pool = Pool((n + 2) * max_model_len, bytes_per_token)
    llm = load_llm(
        args.model,
        "sharing",
        prefix_caching=False,
        block_size=bs,
        kv_cache_memory=pool.bytes,
        max_model_len=max_model_len,
    )
    temp, seed = args.share_temperature, args.seed
    runs: dict[str, GenerateRun] = {}

    def sample(i: int, count: int) -> SamplingParams:
        return SamplingParams(
            n=count, temperature=temp, seed=seed + i, max_tokens=out, ignore_eos=True
        )

    # Prefix cache off: nothing cached by one run can lower the next one's peak.
    runs["independent"] = timed_generate(
        llm, [prompt] * n, [sample(i, 1) for i in range(n)], "no sharing"
    )
    runs["parallel"] = timed_generate(llm, [prompt], sample(0, n), "parallel sampling")
    skipped = None
    try:
        beam = SamplingParams(
            n=n, use_beam_search=True, beam_width=n, temperature=0, max_tokens=out,
            ignore_eos=True,
        )  # fmt: skip
        run = timed_generate(llm, [prompt], beam, "beam search")
        skipped = beam_problem(run, n)
        if skipped is None:
            runs["beam"] = run
    except Exception as exc:  # beam search may not exist yet: report, do not fail the benchmark
        skipped = f"{type(exc).__name__}: {exc}"
    for name, run in runs.items():
        log(f"sharing, {name}: peak KV blocks {run.stats['peak_kv_blocks_used']}")
    del llm
    gc.collect()
    return runs, skipped, pool, max_model_len


def sharing_section(
    prompt: list[int],
    runs: dict[str, GenerateRun],
    skipped: str | None,
    pool: Pool,
    max_model_len: int,
    args: Any,
) -> tuple[str, dict[str, Any]]:
    n, bs = args.share_n, args.block_size
    base = runs["independent"].stats["peak_kv_blocks_used"]
    names = {
        "independent": f"{n} independent requests (no sharing)",
        "parallel": f"n={n} parallel sampling (fork, copy-on-write)",
        "beam": f"beam search, width {n}",
    }
    headers = [
        "configuration", "sequences", "generated tokens", "peak KV blocks", "peak KV MiB",
        "saved vs no sharing", "preemptions", "elapsed s",
    ]  # fmt: skip
    rows = []
    saved: dict[str, float] = {}
    for name, run in runs.items():
        blocks = run.stats["peak_kv_blocks_used"]
        saved[name] = 1 - blocks / base
        rows.append([
            names[name], sum(len(o) for o in run.outputs), run.generated_tokens, blocks,
            blocks * bs * pool.bytes_per_token / 2**20,
            pct(saved[name]) if name != "independent" else "-", run.stats["preemptions"],
            run.wall_s,
        ])  # fmt: skip
    if skipped is not None:
        rows.append([names["beam"], "-", "-", "-", "-", f"skipped: {skipped}", "-", "-"])
    lines = [
        f"One prompt of {len(prompt)} tokens (chat template: summarize ShareGPT text), "
        f"{args.share_output_tokens} output tokens per sequence (ignore_eos); sampling at "
        f"temperature {args.share_temperature}. Block size {bs}, max_model_len {max_model_len}, "
        f"KV pool {pool.tokens:,} tokens, prefix cache off. Peak KV blocks: the most blocks in "
        "use at any step.",
        "",
        markdown_table(headers, rows),
    ]
    result = {
        "prompt_tokens": len(prompt),
        "output_tokens": args.share_output_tokens,
        "pool_tokens": pool.tokens,
        "saved": saved,
        "beam_skipped": skipped,
        "runs": {k: v.as_json() for k, v in runs.items()},
    }
    return "\n".join(lines), result


# --- main --------------------------------------------------------------------------------------

SECTIONS = ("paged", "sweep", "sharing")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    p.add_argument("--block-size", type=int, default=16, help="for sections paged and sharing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g = p.add_argument_group("paged: paged vs static on ShareGPT")
    g.add_argument("-n", "--num-requests", type=int, default=32)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--pool-seqs", type=int, default=8, help="KV pool = this x max_model_len")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts: skipped")
    g.add_argument("--max-output-tokens", type=int, default=384)
    g.add_argument("--min-output-tokens", type=int, default=4)
    g = p.add_argument_group("sweep: block sizes (paged)")
    g.add_argument("--block-sizes", default="4,8,16,32,64,128,256")
    g.add_argument("--sweep-requests", type=int, default=16, help="first N of the workload")
    g.add_argument("--sweep-max-output-tokens", type=int, default=128)
    g = p.add_argument_group("sharing: parallel sampling and beam search vs no sharing")
    g.add_argument("--share-prompt-tokens", type=int, default=1000)
    g.add_argument("--share-output-tokens", type=int, default=128)
    g.add_argument("--share-n", type=int, default=4, help="samples, beams, independent requests")
    g.add_argument("--share-temperature", type=float, default=0.8)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny run (< 1 min) to check it works")
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if args.smoke:
        args.num_requests, args.max_model_len, args.pool_seqs = 6, 128, 2
        args.max_prompt_tokens, args.max_output_tokens = 64, 24
        args.block_sizes, args.sweep_requests, args.sweep_max_output_tokens = "8,16,64", 3, 8
        args.share_prompt_tokens, args.share_output_tokens = 64, 8
    if args.max_prompt_tokens + args.max_output_tokens > args.max_model_len:
        p.error("--max-prompt-tokens + --max-output-tokens must fit in --max-model-len")
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
    tokenizer = load_tokenizer(args.model)  # workloads first, engines per configuration below
    env = environment()
    report: list[str] = [
        f"## KV cache: paged vs static allocation, block sizes, sharing ({env['date_utc']})",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Model {args.model}, float32 ({bytes_per_token:,} bytes of K/V per token), "
        f"{env['torch_threads']} torch threads, CPU {env['cpu']} ({env['cpu_count']} cores), "
        f"torch {env['torch']}. Times are wall clock around one generate call after a warm-up.",
    ]
    results: dict[str, Any] = {}
    pool = Pool(args.pool_seqs * args.max_model_len, bytes_per_token)
    requests: list[WorkloadRequest] = []
    if "paged" in sections or "sweep" in sections:
        requests = sample_sharegpt(
            tokenizer, args.num_requests, args.seed, args.max_prompt_tokens,
            args.max_output_tokens, args.min_output_tokens,
        )  # fmt: skip

    kept: LLM | None = None
    if "paged" in sections:
        runs, kept = paged_vs_static(args, requests, pool, keep_paged="sweep" in sections)
        text, results["paged"] = paged_section(requests, runs, pool, args)
        report += ["", "### Paged vs static allocation at the same KV memory", "", text]
    if "sweep" in sections:
        cap = args.sweep_max_output_tokens
        subset = [
            WorkloadRequest(r.id, r.prompt_token_ids, min(r.output_len, cap), r.reply_len)
            for r in requests[: args.sweep_requests]
        ]
        sweep_runs = block_size_sweep(args, subset, pool, kept)
        kept = None
        text, results["sweep"] = sweep_section(subset, sweep_runs, pool, args)
        report += ["", "### Block size sweep (paged)", "", text]
    if "sharing" in sections:
        prompt = long_prompt(tokenizer, args.share_prompt_tokens, args.seed)
        share_runs, skipped, share_pool, max_len = sharing(args, prompt, bytes_per_token)
        text, results["sharing"] = sharing_section(
            prompt, share_runs, skipped, share_pool, max_len, args
        )
        report += ["", "### Memory saved by sharing blocks", "", text]

    print("\n".join(report))
    if args.out:
        write_json(
            args.out,
            {
                "command": command_line(),
                "args": args_json(args),
                "environment": env,
                "targets": {
                    "paged_waste": TARGET_PAGED_WASTE,
                    "concurrency": TARGET_CONCURRENCY,
                    "throughput": TARGET_THROUGHPUT,
                },
                **results,
            },
        )
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
