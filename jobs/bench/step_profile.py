"""Where a decode step's time goes, at a given number of running sequences.

    python -m jobs.bench.step_profile --running 64,256      # py-spy comes with the dev extra
    python -m jobs.bench.step_profile --samples spy.txt     # bucket a saved `py-spy -f raw`

For each batch size one generate call admits and prefills that many ShareGPT prompts in one
step (the pool and max_num_seqs sized to hold them all); at its first pure decode step (every
sequence one token more, no prompt token computed, seen through LLM.generate's on_step) py-spy
attaches to this process and samples --steps decode steps, then stops. The samples are bucketed
by the innermost frame of ours they fall in: linears (every linear method of batchpage/ops),
lm_head (the logits matmul), attention (the backends and kernels), norms, rope, activations, the
model's other code (embedding, residuals, logits gather), sampling, stop checks and
detokenization, building the step's tensors, the scheduler, and the rest of the engine's Python.
Prints one Markdown table: the share of each bucket, and the decode step's mean wall time.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from batchpage import LLM, SamplingParams
from batchpage.model.loader import load_tokenizer
from jobs.bench import report
from jobs.bench.workloads import sharegpt_workload

# (bucket, substrings of a py-spy frame "function (file:line)"), matched innermost frame first.
BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Every linear implementation (batchpage/ops: torch's, oneDNN's, the bf16 kernel's) before
    # the model's and the kernels' catch-alls below.
    (
        "linears",
        (
            "forward (torch/nn/modules/linear.py",
            "ops/linear.py",
            "onednn_linear.py",
            "bf16_linear.py",
        ),
    ),  # fmt: skip
    ("lm_head", ("compute_logits",)),
    # The layer ops (batchpage/ops/layer_ops.py and compiled_layer_ops.py) by op.
    ("norms", ("rms_norm (", "norm_into (", "RMSNorm.forward")),
    ("rope", ("rope.py", "rope_ (")),
    ("activations", ("silu_mul (", "act_fn", "gelu", "silu")),
    ("attention", ("attention/", "kernels/", "StepAttention", "PagedAttention")),
    ("model, other", ("model/",)),
    ("sampling", ("sampler.py", "constraint.py")),
    ("stop checks, detokenize", ("stop_checker.py",)),
    ("step tensors", ("step_inputs.py",)),
    ("scheduler", ("scheduler.py", "kv_manager.py", "admission.py", "cache/")),
    ("engine, other", ("engine/", "metrics.py", "llm.py")),
)
OUTSIDE = "outside the step"
HOOK = "on_step ("  # this module's callback: py-spy's own start and stop, never a step's work


def bucket_of(stack: list[str]) -> str:
    """The bucket of a sample's stack (frames outermost first)."""
    for frame in reversed(stack):
        for name, keys in BUCKETS:
            if any(k in frame for k in keys):
                # The lm_head is a linear module too: its bucket is the caller's.
                if name == "linears" and any("compute_logits" in f for f in stack):
                    return "lm_head"
                return name
    return OUTSIDE


def read_samples(path: Path) -> Counter[str]:
    """py-spy's raw format: 'frame;frame;...;frame count' per line. A stack inside LLM.generate
    counts, unless it is in the callback that starts and stops py-spy."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        stack = stack_text.split(";")
        if any("generate (" in f for f in stack) and not any(HOOK in f for f in stack):
            counts[bucket_of(stack)] += int(count)
    return counts


def profile(args: argparse.Namespace, running: int) -> tuple[Counter[str], float]:
    """(the samples of --steps decode steps at `running` sequences, their mean seconds)."""
    tok = load_tokenizer(args.model)
    prompts = sharegpt_workload(tok, running, args.seed, args.max_prompt).prompts
    llm = LLM(
        args.model, dtype=args.dtype, max_num_seqs=running, prefix_caching=False,
        max_model_len=args.max_prompt + 2 * args.steps + 16, kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=sum(map(len, prompts)),  # every prompt in one prefill step
    )  # fmt: skip
    out = Path(tempfile.mkdtemp()) / "spy.txt"
    state: dict[str, Any] = {"last": None, "steps": 0}

    def on_step(stats: Any) -> None:
        now = (stats.prefill_tokens_computed, stats.generated_tokens)
        decoded = state["last"] and now[0] == state["last"][0] and now[1] - state["last"][1]
        state["last"] = now
        if decoded != running or state["steps"] > args.steps:
            return
        if "spy" not in state:  # the first pure decode step: sample the ones after it
            state["spy"] = subprocess.Popen(
                ["py-spy", "record", "-p", str(os.getpid()), "-r", str(args.rate), "-f", "raw",
                 "-o", str(out), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(2.0)  # py-spy attaches
            state["start"] = time.perf_counter()
        elif state["steps"] == args.steps:
            state["seconds"] = (time.perf_counter() - state["start"]) / args.steps
            state["spy"].send_signal(signal.SIGINT)
            state["spy"].wait(timeout=60)
        state["steps"] += 1

    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False, on_step=on_step)
    if "seconds" not in state:
        raise SystemExit(f"{running} running: fewer than {args.steps} pure decode steps")
    return read_samples(out), state["seconds"]


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__, smoke=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--running", default="64,256", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=30, help="decode steps sampled per batch size")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=float, default=6e9, help="bytes")
    p.add_argument("--samples", type=Path, default=None, help="bucket this py-spy raw file")
    args = p.parse_args(argv)
    results: dict[str, tuple[Counter[str], float | None]] = {}
    if args.samples:
        results[args.samples.name] = (read_samples(args.samples), None)
    else:
        if subprocess.run(["py-spy", "--version"], capture_output=True).returncode != 0:
            sys.exit("py-spy is needed: pip install py-spy")
        for n in report.ints(args.running):
            report.log(f"{n} running: prefill, then {args.steps} decode steps under py-spy")
            results[f"{n} running"] = profile(args, n)
    rows = []
    for name in [b for b, _ in BUCKETS] + [OUTSIDE]:
        shares = [counts[name] / (sum(counts.values()) or 1) for counts, _ in results.values()]
        rows.append([name, *(f"{s:.1%}" for s in shares)])
    if not args.samples:
        rows.append(["decode step (ms)", *(f"{s * 1000:.1f}" for _, s in results.values())])
    env = report.environment()
    report.print_header("Where a decode step's time goes", env, f"dtype {args.dtype}")
    print(report.markdown_table(["share of a decode step", *results], rows))
    report.save_results(args.out, env, {name: dict(c) for name, (c, _) in results.items()})


if __name__ == "__main__":
    main()
