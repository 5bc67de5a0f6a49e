"""The engine with each CPU linear backend in one process, taking turns: the same engine, its
linears swapped between oneDNN's prepacked PackedLinear, batchpage's bf16 kernel (Bf16DotLinear
with SiLU(gate) * up fused into the gate/up linear, bfloat16 on AVX512-BF16) and plain F.linear
before each run.

    python -m jobs.bench.linears_ab --dtype bfloat16 --runs 4 --decode-steps 64
    python -m jobs.bench.linears_ab --smoke          # seconds: does it run?

Workloads are cpu_kernels_ab.py's (the peer benchmark's shared system prompt, 5-shot HumanEval
prompt and 64 ShareGPT first turns, greedy with ignore_eos, the prefix cache emptied before every
run), and --decode-steps N times pure decode steps at N running sequences, the sides taking
turns every few steps. Reports each side's median and its ratio to oneDNN, and how many requests
got oneDNN's greedy tokens (in bf16 two summation orders can part at near-ties).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import nn

from batchpage import LLM
from batchpage.model.layers import GatedMLP
from batchpage.model.packed_linear import LinearPacking, bf16_dot_kernel, linear_packing
from jobs.bench.cpu_kernels_ab import ab_arguments, decode_step_ms, print_ab_report
from jobs.bench.cpu_prefill_routes import take_turns, workload_llm, workloads

BASELINE = "onednn"


def backends(dtype: torch.dtype) -> dict[str, LinearPacking | None]:
    """The sides this CPU can run for `dtype`: oneDNN, the bf16 kernel where it applies, and
    F.linear (None)."""
    cpu = torch.device("cpu")
    sides: dict[str, LinearPacking | None] = {BASELINE: linear_packing("onednn", dtype, cpu)}
    if bf16_dot_kernel(dtype, cpu, required=False) is not None:
        sides["avx512_bf16"] = linear_packing("avx512_bf16", dtype, cpu)
    sides["torch"] = None
    return sides


def swapper(
    llm: LLM, packings: dict[str, LinearPacking | None]
) -> dict[str, Callable[[LLM], None]]:
    """One setup per side for an engine built with linear_backend='torch': each packs every
    nn.Linear (and a tied lm_head) once, up front, as CausalLM.prepack_linears would (SiLU
    GatedMLPs' gate/up fused where the side fuses them), and its setup puts its modules in
    place."""
    model = llm.engine.runner.model
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    gated = {
        f"{name}.gate_up_proj"
        for name, m in model.named_modules()
        if isinstance(m, GatedMLP) and m.silu_gated and m.gate_up_proj.bias is None
    }
    tied = model.lm_head is None
    setups: dict[str, Callable[[LLM], None]] = {}
    for side, packing in packings.items():
        fuse = packing is not None and packing.silu_mul is not None

        def make(name: str, m: nn.Linear, packing: LinearPacking | None = packing) -> nn.Module:
            if packing is None:
                return m
            if packing.silu_mul is not None and name in gated:
                return packing.silu_mul(m.weight)
            return packing.linear(m.weight, m.bias)

        modules = {name: make(name, m) for name, m in linears}
        head = (
            None if packing is None or not tied else packing.linear(model.embed_tokens.weight, None)
        )

        def setup(_: LLM, modules: dict[str, nn.Module] = modules, head=head, fuse=fuse) -> None:
            for name, module in modules.items():
                parent, _, leaf = name.rpartition(".")
                owner = model.get_submodule(parent)
                setattr(owner, leaf, module)
                if name in gated:
                    owner.gate_up_activated = fuse
            model.tied_head = head

        setups[side] = setup
    return setups


def main(argv: list[str] | None = None) -> None:
    args = ab_arguments(__doc__).parse_args(argv)
    runs = 1 if args.smoke else args.runs
    packings = backends(getattr(torch, args.dtype))
    names = list(packings)
    rows, results = [], []
    for w in workloads(args.model, args.smoke):
        llm = workload_llm(args.model, args.dtype, w, linear_backend="torch")
        rates, tokens = take_turns(llm, w, swapper(llm, packings), runs, f"{w.name} {args.dtype}")
        med = {name: statistics.median(v) for name, v in rates.items()}
        same = {
            name: sum(a == b for a, b in zip(tokens[name], tokens[BASELINE], strict=True))
            for name in names
        }
        results.append(
            {"workload": w.name, "dtype": args.dtype, "runs": rates, "median_tok_s": med,
             "vs_onednn": {n: med[n] / med[BASELINE] for n in names},
             "same_greedy_as_onednn": same, "requests": len(w.prompts)}
        )  # fmt: skip
        for n in names:
            rows.append([w.name, n, f"{med[n]:.1f} out tok/s", f"{med[n] / med[BASELINE]:.3f}x",
                         f"{same[n]}/{len(w.prompts)}"])  # fmt: skip
        del llm
    if args.decode_steps:
        turns = 2 if args.smoke else args.turns
        llm_setups: dict[str, Callable[[LLM], None]] = {}

        def lazy(side: str) -> Callable[[LLM], None]:
            def setup(llm: LLM) -> None:  # packs on the first call, when the engine exists
                if not llm_setups:
                    llm_setups.update(swapper(llm, packings))
                llm_setups[side](llm)

            return setup

        times = decode_step_ms(
            args.model, args.dtype, {n: lazy(n) for n in names}, args.decode_steps, turns,
            linear_backend="torch",
        )  # fmt: skip
        med = {n: statistics.median(v) for n, v in times.items()}
        label = f"decode steps at {args.decode_steps} running"
        results.append(
            {"workload": label, "dtype": args.dtype, "step_ms": times, "median_ms": med,
             "vs_onednn": {n: med[BASELINE] / med[n] for n in names}}
        )  # fmt: skip
        for n in names:
            rows.append([label, n, f"{med[n]:.1f} ms a step", f"{med[BASELINE] / med[n]:.3f}x",
                         "-"])  # fmt: skip
    header = ["workload", "linears", "median", "vs oneDNN", "same greedy as oneDNN"]
    setting = f"{args.dtype}, median of {runs}"
    print_ab_report("CPU linear backends in the engine", setting, header, rows, args.out, results)


if __name__ == "__main__":
    main()
