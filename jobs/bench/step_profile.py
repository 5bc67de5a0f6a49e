"""Where a decode step's time goes, at a given number of running sequences.

    python -m jobs.bench.step_profile --running 64,256      # py-spy comes with the dev extra

For each batch size the engine first admits and prefills that many ShareGPT prompts (the pool and
max_num_seqs sized to hold them all), then py-spy samples this process while --steps decode steps
run; the samples are bucketed by the innermost frame of ours that they fall in: linears
(nn.Linear, MergedLinear), lm_head (the logits matmul), attention (the backends and kernels),
norms, rope, activations, the model's other code (embedding, residuals, logits gather),
sampling, stop checks and detokenization, building the step's tensors, the scheduler, and the
rest of the engine's Python.
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
from batchpage.cpu_info import cpu_model
from batchpage.model.loader import load_tokenizer
from jobs.bench.report import command_line, log, markdown_table
from jobs.bench.workloads import sample_sharegpt

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
    ),
    ("lm_head", ("compute_logits",)),
    # The layer ops (batchpage/ops/layer_ops.py and cpu_layer_ops.py) by op.
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


def bucket_of(stack: list[str]) -> str:
    """The bucket of a sample's stack (frames outermost first)."""
    for frame in reversed(stack):
        for name, keys in BUCKETS:
            if any(k in frame for k in keys):
                # The lm_head is a linear module too: its bucket is the caller's.
                if name == "linears" and any("compute_logits" in f for f in stack):
                    return "lm_head"
                return name
    return "outside the step"


def read_samples(path: Path, marker: str) -> Counter[str]:
    """py-spy's raw format: 'frame;frame;...;frame count' per line; only stacks that pass
    through `marker` (the decode loop) count."""
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        stack = stack_text.split(";")
        if any(marker in f for f in stack):
            counts[bucket_of(stack)] += int(count)
    return counts


def decode_steps(llm: LLM, steps: int) -> None:
    """The marker frame: py-spy samples taken inside this function are the decode steps."""
    for _ in range(steps):
        llm.engine.step()


def decoding_llm(
    model: str,
    dtype: str,
    running: int,
    steps: int,
    max_prompt: int = 256,
    kv_cache_memory: float = 6e9,
    seed: int = 0,
    **engine_args: Any,
) -> LLM:
    """An engine with `running` ShareGPT prompts admitted and prefilled, so that its next
    `steps` steps are pure decode steps of `running` sequences (`engine_args`: more LLM
    arguments)."""
    tok = load_tokenizer(model)
    reqs = sample_sharegpt(tok, running, seed=seed, max_prompt_tokens=max_prompt)
    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=running,
        max_model_len=max_prompt + steps + 16,
        prefix_caching=False,
        kv_cache_memory=kv_cache_memory,  # room for every sequence to its end
        # Every prompt in one prefill step, so no sequence finishes before the last is in.
        max_num_batched_tokens=running * max_prompt,
        **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    requests = [llm._make_request(i, r.prompt_token_ids, params) for i, r in enumerate(reqs)]
    llm.engine.add_requests(requests)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.engine.scheduler.running) \
            or llm.engine.scheduler.waiting:  # fmt: skip
        llm.engine.step()  # prefill everything: what follows are pure decode steps
    assert len(llm.engine.scheduler.running) == running, "not all sequences are running"
    return llm


def profile(args: argparse.Namespace, running: int) -> tuple[Counter[str], float]:
    llm = decoding_llm(
        args.model, args.dtype, running, args.steps, args.max_prompt, args.kv_cache_memory,
        args.seed,
    )  # fmt: skip
    out = Path(tempfile.mkdtemp()) / "spy.txt"
    spy = subprocess.Popen(
        ["py-spy", "record", "-p", str(os.getpid()), "-r", str(args.rate), "-f", "raw",
         "-o", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(2.0)  # py-spy attaches
    start = time.perf_counter()
    decode_steps(llm, args.steps)
    step_s = (time.perf_counter() - start) / args.steps
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    return read_samples(out, "decode_steps"), step_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--running", default="64,256", help="comma-separated batch sizes")
    p.add_argument("--steps", type=int, default=30, help="decode steps sampled per batch size")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=float, default=6e9, help="bytes")
    args = p.parse_args(argv)
    if subprocess.run(["py-spy", "--version"], capture_output=True).returncode != 0:
        sys.exit("py-spy is needed: pip install py-spy")
    sizes = [int(x) for x in args.running.split(",")]
    results = {}
    for n in sizes:
        log(f"{n} running sequences: prefill, then {args.steps} decode steps under py-spy")
        results[n] = profile(args, n)
    names = [b for b, _ in BUCKETS] + ["outside the step"]
    rows = []
    for name in names:
        cells = []
        for n in sizes:
            counts, _ = results[n]
            total = sum(counts.values()) or 1
            cells.append(f"{counts[name] / total:.1%}")
        rows.append([name, *cells])
    rows.append(["decode step (ms)", *[f"{results[n][1] * 1000:.1f}" for n in sizes]])
    print(f"\n{command_line()}\nCPU: {cpu_model()}, dtype {args.dtype}\n")
    print(markdown_table(["share of a decode step", *[f"{n} running" for n in sizes]], rows))


if __name__ == "__main__":
    main()
