"""Speculative decoding's ceiling on a model whose drafts nothing can copy (#71): the speed-up
against running count when the drafts are right, on the 1B-class random-weight shape.

    python -m jobs.bench.speculative_oracle                   # 1/4/16/64 running, 100% and 50%
    python -m jobs.bench.speculative_oracle --running 1,4 --shares 1 --tokens 32
    python -m jobs.bench.speculative_oracle --smoke           # the tiny model: does it run?

Random weights copy nothing from a prompt, so n-gram and suffix drafts from a row's own tokens
are rarely right. Suffix decoding also drafts from the outputs of the engine's earlier finished
requests (its job-wide cache): the same prompts generated a second time draft from their own
first outputs, which greedy decoding repeats token for token. That is an oracle drafter reached
through the public `speculative_config` alone (method "suffix"; --spec-factor raises
suffix_decoding_max_spec_factor so that a draft is not capped at the short match lengths of an
output's first tokens).

For each running count (max_num_seqs) and --shares value s: two engines, one without
speculation and one with suffix decoding (k = --k). A warm pass gives each engine's prefix
cache every prompt, and the suffix engine's output cache the first outputs of a share s of the
prompts (every 1/s-th one; the others run one token, so that their prompts are cached too);
then --rounds timed passes over all prompts, the two engines in turns, each row --tokens out
(ignore_eos, greedy). With s = 1 every row drafts from its own first output; with s = 0.5 half
the rows have nothing cached and draft only from their own tokens, so acceptance over all
drafted tokens lands near what the rows that guess half right would give (the measured figure
is printed; it is not set). Each pair reports both sides' output tok/s, the ratio, drafted and
accepted tokens, steps, and whether every row's tokens are the same with and without drafts.

The issue's goal: >= 2.5x at 1 running with 100% acceptance; where the adaptive cost model
turns speculation off (the ratio falling to 1.0x as the batch grows) must show in the curve.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from batchpage import SamplingParams
from batchpage.model.loader import resolve_model_source
from jobs.bench import report
from jobs.bench.engine_runs import load_llm, log, timed_generate
from jobs.bench.random_models import random_model_folder
from jobs.bench.speculative_vllm import print_rows

HEADERS = ["running", "cached share", "off out tok/s", "spec out tok/s", "ratio", "drafted",
           "accepted", "acceptance", "off steps", "spec steps", "same tokens"]  # fmt: skip


def prompts_for(count: int, vocab: int, low: int, high: int, seed: int) -> list[list[int]]:
    """`count` prompts of `low` to `high` random ids above the first few (special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def cached_rows(count: int, share: float) -> set[int]:
    """The rows whose first outputs the suffix engine caches: every (1/share)-th one."""
    return {i for i in range(count) if share > 0 and int(i * share) != int((i + 1) * share)}


def run_case(args: argparse.Namespace, model: str, running: int, share: float) -> dict[str, Any]:
    """One running count and cached share: warm passes, then the timed passes in turns."""
    source = resolve_model_source(model)
    vocab = source.config.vocab_size
    rows = running * args.waves
    prompts = prompts_for(rows, vocab, 32, 64, args.seed + running)
    spec = {"method": "suffix", "num_speculative_tokens": args.k,
            "suffix_decoding_max_spec_factor": args.spec_factor}  # fmt: skip
    base = {"dtype": args.dtype, "max_num_seqs": running, "max_model_len": 64 + args.tokens + 1,
            "batch_invariant": args.batch_invariant}  # fmt: skip
    llms = {
        "off": load_llm(model, f"{running} running, off", **base),
        "spec": load_llm(model, f"{running} running, suffix", **base, speculative_config=spec),
    }
    full = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    kept = cached_rows(rows, share)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llms["off"].generate(inputs, full, use_tqdm=False)
    warm = [full if i in kept else one for i in range(rows)]
    llms["spec"].generate(inputs, warm, use_tqdm=False)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "spec": []}
    for r in range(args.rounds):
        for side in ("off", "spec") if r % 2 == 0 else ("spec", "off"):
            got = timed_generate(llms[side], inputs, full)
            got["tokens"] = [o[0] for o in got.pop("outputs")]
            runs[side].append(got)
            log(f"{running} running, share {share}, {side}: {got['output_tok_s']:.1f} out tok/s, "
                f"{got['stats']['accepted_draft_tokens']}/{got['stats']['draft_tokens']} drafts "
                "accepted")  # fmt: skip
    off, on = runs["off"], runs["spec"]
    drafted = sum(r["stats"]["draft_tokens"] for r in on)
    accepted = sum(r["stats"]["accepted_draft_tokens"] for r in on)
    same = sum(a == b for x, y in zip(off, on, strict=True)
               for a, b in zip(x["tokens"], y["tokens"], strict=True))  # fmt: skip
    off_tok_s = statistics.median(r["output_tok_s"] for r in off)
    spec_tok_s = statistics.median(r["output_tok_s"] for r in on)
    return {
        "running": running, "cached_share": share, "rows": rows, "cached_rows": len(kept),
        "rounds": args.rounds,
        "off_output_tok_s": off_tok_s, "spec_output_tok_s": spec_tok_s,
        "ratio": spec_tok_s / off_tok_s, "draft_tokens": drafted,
        "accepted_draft_tokens": accepted, "acceptance": accepted / drafted if drafted else None,
        "off_steps": off[0]["stats"]["steps"], "spec_steps": on[0]["stats"]["steps"],
        "same_tokens": same, "compared_rows": rows * args.rounds,
    }  # fmt: skip


def table_row(p: dict[str, Any]) -> list[Any]:
    acceptance = "-" if p["acceptance"] is None else f"{100 * p['acceptance']:.1f}%"
    same = f"{p['same_tokens']}/{p['compared_rows']}"
    return [p["running"], p["cached_share"], p["off_output_tok_s"], p["spec_output_tok_s"],
            f"{p['ratio']:.2f}x", p["draft_tokens"], p["accepted_draft_tokens"], acceptance,
            p["off_steps"], p["spec_steps"], same]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = report.parser(__doc__)
    p.add_argument("--model", default="1b", help="a random_models shape or a model path")
    p.add_argument("--dtype", default="auto", help="auto: the CPU's fast dtype")
    p.add_argument("--running", default="1,4,16,64", help="comma list of max_num_seqs")
    p.add_argument("--shares", default="1,0.5", help="comma list of cached shares")
    p.add_argument("--waves", type=int, default=2, help="rows: this many times running")
    p.add_argument("--tokens", type=int, default=64, help="output tokens of every row")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--spec-factor", type=float, default=8.0,
                   help="suffix_decoding_max_spec_factor")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="timed passes per side; medians count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-invariant", action="store_true", help="both sides: tokens must match")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.running, args.tokens, args.rounds = "tiny", "2", 8, 1
    if min(args.waves, args.tokens, args.k, args.rounds) < 1:
        p.error("--waves, --tokens, --k and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = report.environment()
    shapes = ("tiny", "1b")
    model = str(random_model_folder(args.model)) if args.model in shapes else args.model
    report.print_header(
        "Speculative decoding with drafts replayed from the model's own outputs", env,
        f"{args.model}, dtype {args.dtype}, k {args.k}, spec factor {args.spec_factor}, "
        f"{args.tokens} tokens a row, {args.waves} waves of rows, {args.rounds} round(s)",
    )  # fmt: skip
    pairs: list[dict[str, Any]] = []
    for share in (float(s) for s in args.shares.split(",")):
        for running in report.ints(args.running):
            p = run_case(args, model, running, share)
            print_rows(HEADERS, [table_row(p)], head=not pairs)
            pairs.append(p)
            if args.out is not None:  # what was measured survives a cut run
                report.write_json(args.out, {"command": report.command_line(),
                                             "environment": env, "results": pairs})  # fmt: skip
    report.save_results(args.out, env, pairs, args)


if __name__ == "__main__":
    main()
