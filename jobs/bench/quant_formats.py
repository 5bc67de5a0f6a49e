"""Each quantized format on the CPU at hand: the 1B-class random Llama as each kind of checkpoint
the int kernels take (jobs/bench/random_models.py), its weight bytes as held and its speed,
against the same shape dense in the same dtype.

    python -m jobs.bench.quant_formats
    python -m jobs.bench.quant_formats --variants dense,int4,fp8 --dtype float32 \
        --out jobs/bench/results/quant_formats_f32.json

Every variant runs with `quantized_weights=true` (its layers packed, never held dense), the
dense reference with its weights as written. Per variant, its best of --rounds (the variants
taking turns, round after round): `llm.stats["weight_bytes"]` and
`weight_formats`, the median pure decode step at each --running (greedy, ignore_eos), and the
output tok/s of --requests random prompts. AWQ, GPTQ and compressed-tensors int4 (and GGUF
Q4_0 / Q4_1) become the same IntWeight on the same kernel, so one int4 row stands for them;
"w8a8" is the int8 per-channel checkpoint with `int8_activations=true`. Compare within one
run. Prints Markdown with the CPU; --out writes JSON.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from jobs.bench import report
from jobs.bench.engine_runs import decode_steps, load_llm, log, run_greedy
from jobs.bench.random_models import random_model_folder

# name -> (what it stands for, random_models variant, extra LLM options)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dense": ("dense, the engine's dtype", "1b", {}),
    "int4": ("int4 g128 (GPTQ; AWQ, CT W4A16 alike)", "1b-gptq4", {"quantized_weights": True}),
    "int8": ("int8 g128 (W8A16)", "1b-gptq8", {"quantized_weights": True}),
    "w8a8": ("int8 per channel, int8 activations (W8A8)", "1b-gptq8-channel",
             {"quantized_weights": True, "int8_activations": True}),
    "fp8": ("FP8 e4m3, 128 x 128 blocks", "1b-fp8", {"quantized_weights": True}),
}  # fmt: skip


def measure(
    name: str, options: dict[str, Any], args: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    label, variant, extra = VARIANTS[name]
    folder = str(random_model_folder(variant))
    llm = load_llm(folder, name, dtype=args.dtype, kv_cache_memory=args.kv_gib * 2**30,
                   **options, **extra)  # fmt: skip
    rng = random.Random(0)
    row: dict[str, Any] = {"format": label, "name": name, "model": variant}
    for running in report.ints(args.running):
        prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(running)]
        steps = decode_steps(llm, prompts, args.steps)["step_s"]
        row[f"decode_{running}_ms"] = 1e3 * statistics.median(steps)
    lo, hi = report.ints(args.prompt_tokens)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.requests)]  # fmt: skip
    run = run_greedy(llm, prompts, [args.max_tokens] * args.requests)
    row["out_tok_s"] = run["output_tok_s"]
    row["weight_bytes"] = run["stats"]["weight_bytes"]
    row["weight_formats"] = run["stats"]["weight_formats"]
    log(f"{name}: {row}")
    return row


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's best figures over its rounds: on a shared machine one engine's decode steps
    were seen at 70 ms in one turn and 42 ms in the next, the same shape and weights' size."""
    row = dict(runs[0])
    for key in row:
        if key.startswith("decode_"):
            row[key] = min(r[key] for r in runs)
    row["out_tok_s"] = max(r["out_tok_s"] for r in runs)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="names of VARIANTS, or all")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--running", default="1,8", help="decode steps at these many running")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", default="64,128")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2, help="each variant's best of this many")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    env = report.environment()
    vocab = 49152  # the 1B shape's (random_models.SHAPES["1b"])
    options = {"max_num_seqs": max(8, *report.ints(args.running), args.requests)}
    rounds = [[measure(n, options, args, vocab) for n in names] for _ in range(args.rounds)]
    rows = [best([r[i] for r in rounds]) for i in range(len(names))]
    dense = next((r for r in rows if r["name"] == "dense"), None)
    report.print_header(f"Quantized formats, {args.dtype}", env)
    running = report.ints(args.running)
    headers = ["format", "held as", "weight MiB", *[f"decode {r} ms" for r in running],
               "out tok/s"]  # fmt: skip
    if dense is not None:
        headers += ["bytes vs dense", *[f"decode {r} vs dense" for r in running],
                    "tok/s vs dense"]  # fmt: skip
    table = []
    for r in rows:
        held = ", ".join(f"{k} x {v}" for k, v in r["weight_formats"].items())
        decode = [f"{r[f'decode_{n}_ms']:.2f}" for n in running]
        cells = [r["format"], held, f"{r['weight_bytes'] / 2**20:,.0f}", *decode,
                 f"{r['out_tok_s']:.1f}"]  # fmt: skip
        if dense is not None:
            cells += [f"{r['weight_bytes'] / dense['weight_bytes']:.2f}",
                      *[f"{dense[f'decode_{n}_ms'] / r[f'decode_{n}_ms']:.2f}x" for n in running],
                      f"{r['out_tok_s'] / dense['out_tok_s']:.2f}x"]  # fmt: skip
        table.append(cells)
    print(report.markdown_table(headers, table))
    if args.out:
        report.write_json(args.out, {"command": report.command_line(), "env": env, "rows": rows})
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
