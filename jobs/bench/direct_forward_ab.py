"""The engine's model forward with and without DirectForward (model/direct_forward.py), in one
process, taking turns: the same engine and kernels, the decoder stack run either through its
modules or as direct calls into the kernels.

    python -m jobs.bench.direct_forward_ab --dtype bfloat16 --runs 4 --decode-steps 64
    python -m jobs.bench.direct_forward_ab --smoke          # seconds: does it run?

Workloads are cpu_kernels_ab.py's (the peer benchmark's shared system prompt, 5-shot HumanEval
prompt and 64 ShareGPT first turns, greedy with ignore_eos, the prefix cache emptied before every
run), and --decode-steps N times pure decode steps at N running sequences, the sides taking
turns every few steps. Reports each side's median, the direct path's speedup, and how many
requests got the same greedy tokens both ways (the paths compute the same values, so all).
DirectForward applies to bf16 models on a CPU with AVX512-BF16; elsewhere this says so and stops.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from batchpage import LLM
from batchpage.model.direct_forward import DirectForward
from jobs.bench.cpu_kernels_ab import ab_arguments, decode_step_ms, print_ab_report
from jobs.bench.cpu_prefill_routes import take_turns, workload_llm, workloads

SIDES = ("modules", "direct")


def sides() -> dict[str, Callable[[LLM], None]]:
    """Setups that take the engine's model to each side; the direct path is built on its first
    use and kept."""
    built: dict[int, DirectForward] = {}

    def setup(side: str) -> Callable[[LLM], None]:
        def apply(llm: LLM) -> None:
            model = llm.engine.runner.model
            if model.direct is not None:
                built[id(model)] = model.direct
            model.direct = built.get(id(model)) if side == "direct" else None

        return apply

    return {side: setup(side) for side in SIDES}


def main(argv: list[str] | None = None) -> None:
    args = ab_arguments(__doc__).parse_args(argv)
    runs = 1 if args.smoke else args.runs
    rows, results = [], []
    for w in workloads(args.model, args.smoke):
        llm = workload_llm(args.model, args.dtype, w)
        if llm.engine.runner.model.direct is None:
            raise SystemExit(
                f"DirectForward does not apply to {args.model} in {args.dtype} on this CPU (it "
                "runs bf16 Llama-style models on AVX512-BF16): nothing to compare"
            )
        rates, tokens = take_turns(llm, w, sides(), runs, f"{w.name} {args.dtype}")
        med = {name: statistics.median(v) for name, v in rates.items()}
        same = sum(a == b for a, b in zip(tokens["direct"], tokens["modules"], strict=True))
        speedup = med["direct"] / med["modules"]
        results.append(
            {"workload": w.name, "dtype": args.dtype, "runs": rates, "median_tok_s": med,
             "speedup": speedup, "same_greedy": same, "requests": len(w.prompts)}
        )  # fmt: skip
        rows.append([w.name, f"{med['modules']:.1f} out tok/s", f"{med['direct']:.1f} out tok/s",
                     f"{speedup:.3f}x", f"{same}/{len(w.prompts)}"])  # fmt: skip
        del llm
    if args.decode_steps:
        turns = 2 if args.smoke else args.turns
        times = decode_step_ms(args.model, args.dtype, sides(), args.decode_steps, turns)
        med = {n: statistics.median(v) for n, v in times.items()}
        label = f"decode steps at {args.decode_steps} running"
        speedup = med["modules"] / med["direct"]
        results.append(
            {"workload": label, "dtype": args.dtype, "step_ms": times, "median_ms": med,
             "speedup": speedup}
        )  # fmt: skip
        rows.append([label, f"{med['modules']:.1f} ms a step", f"{med['direct']:.1f} ms a step",
                     f"{speedup:.3f}x", "-"])  # fmt: skip
    title = "The decoder stack through its modules and direct"
    header = ["workload", "modules", "direct", "speedup", "same greedy"]
    print_ab_report(title, f"{args.dtype}, median of {runs}", header, rows, args.out, results)


if __name__ == "__main__":
    main()
