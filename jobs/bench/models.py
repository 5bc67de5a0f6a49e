"""Model families on this CPU: decode speed at the same size, and the grouped-expert MoE block
against a per-token loop.

    python -m jobs.bench.models --out bench/models.json     # the real measurement
    python -m jobs.bench.models --smoke                     # < 2 minutes: does it run?

1. decode: one random model per family at the same size (hidden, layers, attention; the MoE
   families with experts whose top-k together are as wide as the dense MLP, so every family does
   the same matmul work per token). --batch prompts of 16 tokens; decode tok/s is
   batch x (N - 1) / (time of max_tokens=N - time of max_tokens=1), prefix cache off. Every
   timing is the best of --repeats rounds that run all families in turn.
2. moe: one MoE block at the decode size, its forward at T tokens grouped by expert (one matmul
   per expert) against a loop over tokens (one matmul per token and chosen expert).

Greedy fidelity to HF transformers for every family and variant is the test suite's
(tests/model/test_families.py). Prints Markdown tables; --out also writes JSON.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from batchpage import LLM, SamplingParams
from batchpage.model.config import MoEConfig
from batchpage.model.moe import SparseMoE
from jobs.bench.report import (
    args_json,
    command_line,
    environment,
    log,
    markdown_table,
    save_results,
    timed,
)
from tests.model_factory import save_hf_folder, tiny_tokenizer


def interleaved_best(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The fastest wall-clock time of each fn over `rounds` rounds that run every fn once in
    turn, so a burst of load from other processes cannot favour one of them."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn)[1])
    return best


# --- 1. decode speed ---------------------------------------------------------------------------


def same_size_configs(args: argparse.Namespace) -> dict[str, PreTrainedConfig]:
    """One config per family; MoE experts sized so that top-2 of them match the dense MLP."""
    size = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    half = args.intermediate // 2
    return {
        "llama": LlamaConfig(**size),
        "qwen3": Qwen3Config(**size, head_dim=args.hidden // args.heads),
        "phi3": Phi3Config(**size),
        "qwen3_moe": Qwen3MoeConfig(
            **size,
            head_dim=args.hidden // args.heads,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=half,
            norm_topk_prob=True,
        ),
        "mixtral": MixtralConfig(**{**size, "intermediate_size": half}, num_local_experts=4),
    }


def decode_speed(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    tokenizer = tiny_tokenizer()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(16)] for _ in range(args.batch)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    runs: dict[str, Callable[[], object]] = {}
    sizes = {}
    for family, config in same_size_configs(args).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = save_hf_folder(model, folder / f"speed_{family}", tokenizer)
        sizes[family] = sum(p.numel() for p in model.parameters())
        del model
        llm = LLM(
            str(path), dtype="float32", prefix_caching=False, max_num_seqs=args.batch,
            max_model_len=256,
        )  # fmt: skip
        llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
        runs[f"{family}/first"] = partial(llm.generate, prompts, first, use_tqdm=False)
        runs[f"{family}/full"] = partial(llm.generate, prompts, full, use_tqdm=False)
    best = interleaved_best(runs, args.repeats)
    rows = []
    for family, params in sizes.items():
        tok_s = args.batch * args.decode_tokens / (best[f"{family}/full"] - best[f"{family}/first"])
        log(f"decode {family}: {tok_s:.0f} tok/s ({params / 1e6:.1f} M parameters)")
        rows.append(dict(family=family, parameters=params, decode_tok_s=tok_s))
    return rows


# --- 2. MoE: grouped experts vs a per-token loop ---------------------------------------------


def per_token_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The same routing, then each token's chosen experts one at a time."""
    weights, experts = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist(), strict=True):
            out[t] += w * moe.experts.run(e, x[t : t + 1])[0]
    return out


def moe_ratio(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    shapes = {"qwen3_moe": (8, 2), "mixtral": (4, 2)}
    for family, (experts, top_k) in shapes.items():
        cfg = MoEConfig(experts, top_k, args.intermediate // 2, True, (True,))
        moe = SparseMoE(args.hidden, cfg, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, 0.05)
        for tokens in args.moe_tokens:
            x = torch.randn(tokens, args.hidden)
            with torch.inference_mode():
                torch.testing.assert_close(moe(x), per_token_moe(moe, x), atol=1e-5, rtol=1e-4)
                best = interleaved_best(
                    {"grouped": partial(moe, x), "loop": partial(per_token_moe, moe, x)},
                    args.repeats * 3,
                )
            grouped, loop = best["grouped"], best["loop"]
            log(
                f"moe {family} T={tokens}: grouped {grouped * 1e3:.2f} ms, loop {loop * 1e3:.2f} ms"
            )
            rows.append(
                dict(family=family, experts=experts, top_k=top_k, tokens=tokens,
                     grouped_ms=grouped * 1e3, loop_ms=loop * 1e3, speedup=loop / grouped)
            )  # fmt: skip
    return rows


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sections", default="decode,moe", help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=5, help="timings: best of this many rounds")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--moe-tokens", default="64,512", help="tokens per MoE forward")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="small run to check it works")
    args = p.parse_args(argv)
    args.sections = args.sections.split(",")
    if set(args.sections) - {"decode", "moe"}:
        p.error(f"unknown section(s) in {args.sections}; known: decode, moe")
    args.moe_tokens = [int(t) for t in str(args.moe_tokens).split(",")]
    if args.smoke:
        args.layers, args.batch, args.decode_tokens, args.repeats = 2, 8, 4, 1
        args.moe_tokens = [16]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    print(f"## Model families ({env['date_utc']})\n\nCommand: `{command_line()}`\n")
    print(f"CPU {env['cpu']} ({env['cpu_count']} cores), {env['torch_threads']} torch threads, "
          f"torch {env['torch']}, transformers {env['transformers']}, float32.\n")  # fmt: skip
    results: dict[str, Any] = {}
    if "decode" in args.sections:
        with tempfile.TemporaryDirectory() as tmp:
            rows = results["decode"] = decode_speed(args, Path(tmp))
        llama = next(r["decode_tok_s"] for r in rows if r["family"] == "llama")
        shape = (f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
                 f"{args.kv_heads} KV heads, dense MLP {args.intermediate}, MoE top-2 of experts "
                 f"of {args.intermediate // 2}, vocab {args.vocab}")  # fmt: skip
        print(f"### Decode at batch {args.batch} ({shape})\n")
        cells = [[r["family"], r["parameters"] / 1e6, r["decode_tok_s"],
                  f"{r['decode_tok_s'] / llama:.2f}x"] for r in rows]  # fmt: skip
        print(markdown_table(["family", "parameters (M)", "decode tok/s", "vs llama"], cells))
    if "moe" in args.sections:
        rows = results["moe"] = moe_ratio(args)
        print("\n### MoE block: experts grouped (one matmul per expert) vs a per-token loop\n")
        header = ["family", "experts", "top-k", "tokens", "grouped ms", "loop ms", "speedup"]
        cells = [[r["family"], r["experts"], r["top_k"], r["tokens"], f"{r['grouped_ms']:.2f}",
                  f"{r['loop_ms']:.2f}", f"{r['speedup']:.1f}x"] for r in rows]  # fmt: skip
        print(markdown_table(header, cells))
    if args.out:
        save_results(args.out, env, results, args=args_json(args))


if __name__ == "__main__":
    main()
