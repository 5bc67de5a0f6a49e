"""The engine with this checkout's C++ CPU kernels against those of another git revision, in one
process: the paged-decode kernel, the paged-prefill kernel and the layer ops (norms, SiLU*up,
rope, the greedy argmax) of both are built, and one engine per workload swaps between them run
by run. A revision from before the prefill kernel sends prompt rows through its decode kernel
(the backend's "rows" route; such revisions also sent long chunks behind long contexts to SDPA).

    python -m jobs.bench.cpu_kernels_ab --baseline HEAD~3 --dtype bfloat16 --runs 4
    python -m jobs.bench.cpu_kernels_ab --smoke          # seconds: does it run?

On a shared, noisy machine an A/B inside one process, the two taking turns, is the fair way to
see what a kernel change does to the engine; a figure from another run or another day is not.
Workloads are those of cpu_prefill_routes.py (the peer benchmark's shared system prompt, 5-shot
HumanEval prompt and 64 ShareGPT first turns, greedy with ignore_eos; the prefix cache is
emptied before every run).
Reports each side's median output tok/s, their ratio, and how many requests got the same greedy
tokens (in bf16 two summation orders can part at near-ties).

--decode-steps N also times pure decode steps at N running sequences (ShareGPT prompts prefilled
first, as step_profile.py does): the sides take turns every few steps, and the table gives each
side's median step time. A whole run mixes prefill, decode and a tail of few sequences; this
isolates the steps that dominate a long batch job.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from batchpage import LLM
from batchpage.kernels import cpu_layer_ops, cpu_paged_decode, cpu_paged_prefill
from batchpage.kernels.cpu_build import HEADERS, build_extension
from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from jobs.bench.cpu_prefill_routes import take_turns, workload_llm, workloads
from jobs.bench.report import command_line, environment, print_results
from jobs.bench.step_profile import decoding_llm

Kernels = tuple[CpuPagedDecode, CpuLayerOps, CpuPagedPrefill | None]


def build_baseline(rev: str, folder: Path) -> Kernels:
    """The libraries from revision `rev`'s sources (its header beside them, where their
    #include "cpu_vec.h" finds it first), under names of their own; no prefill kernel where
    `rev` has none."""
    root = Path(cpu_paged_decode.__file__).resolve().parents[1]

    def git(*cmd: str) -> bytes:
        done = subprocess.run(["git", *cmd], cwd=root, capture_output=True, check=False)
        if done.returncode != 0:
            raise SystemExit(
                f"--baseline {rev}: `git {' '.join(cmd)}` failed in {root}: "
                f"{done.stderr.decode().strip()}. Name a commit of this repository whose "
                "kernels/ holds the C++ kernels (e.g. HEAD~1)."
            )
        return done.stdout

    for path in [cpu_paged_decode.SOURCE, cpu_layer_ops.SOURCE, *HEADERS]:
        rel = path.resolve().relative_to(root).as_posix()
        (folder / path.name).write_bytes(git("show", f"{rev}:{rel}"))
    tag = git("rev-parse", "--short", rev).decode().strip()
    prefill = None
    rel = cpu_paged_prefill.SOURCE.resolve().relative_to(root).as_posix()
    if rel in git("ls-tree", "-r", "--name-only", rev, "kernels/").decode().split():
        (folder / cpu_paged_prefill.SOURCE.name).write_bytes(git("show", f"{rev}:{rel}"))
        prefill = CpuPagedPrefill(
            build_extension(
                folder / cpu_paged_prefill.SOURCE.name,
                f"baseline_{tag}_prefill",
                f"the {rev} prefill kernel",
            )  # fmt: skip
        )
    decode = build_extension(
        folder / cpu_paged_decode.SOURCE.name, f"baseline_{tag}_decode", f"the {rev} decode kernel"
    )
    ops = build_extension(
        folder / cpu_layer_ops.SOURCE.name, f"baseline_{tag}_layer_ops", f"the {rev} layer ops"
    )
    return CpuPagedDecode(decode), CpuLayerOps(ops), prefill


def use(llm: LLM, kernels: Kernels) -> None:
    """Put one side's kernels in the engine. Both sides then run the model through its modules:
    use_layer_ops drops the direct path (model/direct_forward.py), whose unchecked calls an older
    revision's library need not take."""
    decode, ops, prefill = kernels
    attention = llm.engine.runner.attention
    attention.kernel = decode
    attention.prefill_route = "rows" if prefill is None else "tiles"
    if prefill is not None:
        attention.prefill = prefill
    assert llm.engine.runner.model.use_layer_ops(ops) > 0
    llm.engine.argmax = greedy_argmax(ops)


def greedy_argmax(ops: CpuLayerOps) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The sampler's argmax as a revision's engine ran it. An older library may predate the
    argmax (then torch's), or take float32 logits only (then the float32 copy of bf16 logits
    that such a revision's model made)."""
    if not ops.has_argmax:
        return None
    try:
        ops.argmax(torch.zeros(1, 2, dtype=torch.bfloat16))
    except RuntimeError:
        return lambda logits: ops.argmax(logits.float())
    return ops.argmax


def decode_step_ms(
    model: str,
    dtype: str,
    setups: dict[str, Callable[[LLM], object]],
    running: int,
    turns: int,
    steps: int = 4,
    **engine_args: Any,
) -> dict[str, list[float]]:
    """Each side's mean decode-step milliseconds, `turns` times: the sides alternate, each turn
    its setup applied to the engine, one untimed step after the switch, then `steps` timed
    ones (`engine_args`: more LLM arguments)."""
    llm = decoding_llm(model, dtype, running, turns * len(setups) * (steps + 1), **engine_args)
    times: dict[str, list[float]] = {name: [] for name in setups}
    names = list(setups)
    for t in range(turns):
        for name in names[t % 2 :] + names[: t % 2]:
            setups[name](llm)
            llm.engine.step()
            start = time.perf_counter()
            for _ in range(steps):
                llm.engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1000)
    return times


def print_ab_report(
    title: str,
    setting: str,
    header: list[str],
    rows: list[list[str]],
    out: str | None,
    results: list[dict[str, Any]],
) -> None:
    """The Markdown every in-process A/B prints (title, command, CPU and `setting`, table), and
    its JSON at `out`."""
    env = environment()
    print(f"## {title} ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(f"CPU: {env['cpu']} ({', '.join(env['cpu_flags'])}), {setting}.\n")
    print_results(header, rows, out, env, results)


def ab_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every in-process A/B of the engine takes (this one and linears_ab.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--runs", type=int, default=4, help="runs per side and workload")
    p.add_argument("--decode-steps", type=int, default=0, help="running sequences (0: skip)")
    p.add_argument("--turns", type=int, default=16, help="turns per side of --decode-steps")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="a tiny workload: does it run?")
    return p


def main(argv: list[str] | None = None) -> None:
    p = ab_arguments(__doc__)
    p.add_argument("--baseline", default="HEAD", help="git revision of the other kernels")
    args = p.parse_args(argv)
    runs = 1 if args.smoke else args.runs
    with tempfile.TemporaryDirectory() as tmp:
        sides: dict[str, Kernels] = {
            "this": (CpuPagedDecode.build(), CpuLayerOps.build(), CpuPagedPrefill.build()),
            "baseline": build_baseline(args.baseline, Path(tmp)),
        }
    rows, results = [], []
    for w in workloads(args.model, args.smoke):
        llm = workload_llm(args.model, args.dtype, w)
        setups = {name: partial(use, kernels=k) for name, k in sides.items()}
        rates, tokens = take_turns(llm, w, setups, runs, f"{w.name} {args.dtype}")
        same = sum(a == b for a, b in zip(tokens["this"], tokens["baseline"], strict=True))
        med = {name: statistics.median(v) for name, v in rates.items()}
        result = {
            "workload": w.name, "dtype": args.dtype, "baseline": args.baseline, "runs": rates,
            "this_tok_s": med["this"], "baseline_tok_s": med["baseline"],
            "this_vs_baseline": med["this"] / med["baseline"], "same_greedy": same,
            "requests": len(w.prompts),
        }  # fmt: skip
        results.append(result)
        rows.append([w.name, args.dtype, med["this"], med["baseline"],
                     f"{result['this_vs_baseline']:.3f}x", f"{same}/{len(w.prompts)}"])  # fmt: skip
        del llm
    if args.decode_steps:
        turns = 2 if args.smoke else args.turns
        setups = {name: partial(use, kernels=k) for name, k in sides.items()}
        times = decode_step_ms(args.model, args.dtype, setups, args.decode_steps, turns)
        med = {name: statistics.median(v) for name, v in times.items()}
        name = f"decode steps at {args.decode_steps} running"
        results.append(
            {"workload": name, "dtype": args.dtype, "baseline": args.baseline, "step_ms": times,
             "this_ms": med["this"], "baseline_ms": med["baseline"],
             "this_vs_baseline": med["baseline"] / med["this"]}
        )  # fmt: skip
        rows.append([name, args.dtype, f"{med['this']:.1f} ms a step",
                     f"{med['baseline']:.1f} ms a step", f"{med['baseline'] / med['this']:.3f}x",
                     "-"])  # fmt: skip
    title = f"CPU kernels in the engine: this checkout against {args.baseline}"
    header = ["workload", "dtype", "this out tok/s", f"{args.baseline} out tok/s",
              "this vs baseline", "same greedy"]  # fmt: skip
    print_ab_report(title, f"median of {runs} runs a side", header, rows, args.out, results)


if __name__ == "__main__":
    main()
