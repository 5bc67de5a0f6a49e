"""How much of this CPU's matmul ceiling each system of a peers run reached.

    python -m jobs.bench.ceiling bench/peers_bfloat16.json --out bench/ceiling_bfloat16.json

`measure_matmul_ceiling` times each linear of the model at step-sized token counts, the best of
F.linear and every engine path that applies (oneDNN's prepacked linears, the bf16 kernel);
`Ceiling` turns the best rates into the least time a workload could take. The command rebuilds
a peers run's workloads from the arguments its JSON recorded (the same seed, so the same token
ids) and prints, per workload and system, the output tok/s against that bound. The bound
computes every prompt token, so a workload whose prompts mostly hit the prefix cache (system,
fewshot) can exceed 100%; the ShareGPT workloads share little. Run it on the machine that made
the JSON, and on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchpage.model.loader import load_tokenizer, resolve_model_source
from batchpage.ops.bf16_linear import Bf16DotLinear, bf16_dot_kernel
from batchpage.ops.onednn_linear import OneDnnLinear, onednn_packs
from jobs.bench.report import environment, log, markdown_table, save_results, timed
from jobs.bench.workloads import Workload, build_workloads


@dataclass(frozen=True)
class LinearShape:
    name: str
    in_features: int
    out_features: int
    count: int = 1  # how many linears of this shape per layer (k and v; gate and up)

    @property
    def flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features * self.count


def llama_shapes(cfg: Any) -> tuple[list[LinearShape], LinearShape]:
    """(the per-layer linears, lm_head) of a Llama-family config (batchpage's ModelConfig)."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    layer = [
        LinearShape("q_proj", hidden, q),
        LinearShape("k_proj+v_proj", hidden, kv, count=2),
        LinearShape("o_proj", q, hidden),
        LinearShape("gate_proj+up_proj", hidden, inter, count=2),
        LinearShape("down_proj", inter, hidden),
    ]
    return layer, LinearShape("lm_head", hidden, cfg.vocab_size)


def matmul_gflops(
    tokens: int, in_features: int, out_features: int, dtype: torch.dtype, min_time_s: float
) -> float:
    """Best observed GFLOP/s of [tokens, in] x [out, in]^T through F.linear and every engine
    path that applies here: oneDNN's prepacked OneDnnLinear where oneDNN packs this dtype, and
    the bf16 kernel (Bf16DotLinear) for bfloat16 on AVX512-BF16. The best call of the fastest,
    not the mean, because a ceiling should not include other processes' interference."""
    x = torch.randn(tokens, in_features, dtype=dtype)
    w = torch.randn(out_features, in_features, dtype=dtype)
    kernels: list[Callable[[], torch.Tensor]] = [lambda: F.linear(x, w)]
    if onednn_packs(dtype, x.device):
        packed = OneDnnLinear(w, None)
        kernels.append(lambda: packed(x))
    bf16 = bf16_dot_kernel(dtype, x.device, required=False)
    if bf16 is not None:
        dot = Bf16DotLinear(w, None, bf16)
        kernels.append(lambda: dot(x))
    flops = 2 * tokens * in_features * out_features
    best = float("inf")
    with torch.inference_mode():
        for kernel in kernels:
            kernel()  # warm-up: first-call allocation and kernel selection
            deadline = time.perf_counter() + min_time_s
            calls = 0
            while calls < 3 or time.perf_counter() < deadline:
                _, seconds = timed(kernel)
                best = min(best, seconds)
                calls += 1
    return flops / best / 1e9


@dataclass(frozen=True)
class Ceiling:
    """Matmul-bound time per token for one model on this machine. It counts only the linears at
    their best measured rate (and attention at the layers' mean rate), so it is an upper bound
    that no real engine reaches: norms, RoPE, sampling and Python overheads are all left out."""

    layer_s_per_token: float  # all layers' linears for one token through the model
    logits_s_per_token: float  # lm_head for one sampled position
    attn_s_per_flop: float
    attn_flops_per_key: int  # per token, per attended key, all layers: QK^T and PV

    def workload_seconds(self, w: Workload) -> float:
        """Least time for the whole workload: each request runs its prompt and all but its last
        output token through the layers, samples its output positions, and attends causally.
        Every prompt token is counted (a prefix cache could skip some)."""
        total = 0.0
        for prompt, outputs in zip(w.prompts, w.max_tokens, strict=True):
            positions = len(prompt) + outputs - 1
            keys = positions * (positions + 1) / 2  # causal: token i attends i keys
            total += positions * self.layer_s_per_token + outputs * self.logits_s_per_token
            total += keys * self.attn_flops_per_key * self.attn_s_per_flop
        return total


def measure_matmul_ceiling(
    cfg: Any,
    token_counts: Sequence[int] = (256, 512, 1024),
    dtype: torch.dtype = torch.float32,
    min_time_s: float = 0.3,
) -> tuple[Ceiling, list[dict[str, Any]]]:
    """Measure each linear shape of the model at each token count (the M of the matmul, i.e. the
    tokens in one step at large batch) and take the best rate per shape. Returns the ceiling and
    one row per (shape, tokens) measurement."""
    layer, lm_head = llama_shapes(cfg)
    rows: list[dict[str, Any]] = []
    best: dict[str, float] = {}
    for shape in [*layer, lm_head]:
        for m in token_counts:
            rate = matmul_gflops(m, shape.in_features, shape.out_features, dtype, min_time_s)
            rows.append(
                {"shape": shape.name, "in": shape.in_features, "out": shape.out_features,
                 "tokens": m, "gflops": rate}
            )  # fmt: skip
            best[shape.name] = max(best.get(shape.name, 0.0), rate)
    layer_s = cfg.num_layers * sum(s.flops_per_token / (best[s.name] * 1e9) for s in layer)
    mean_layer_rate = sum(best[s.name] for s in layer) / len(layer)
    ceiling = Ceiling(
        layer_s_per_token=layer_s,
        logits_s_per_token=lm_head.flops_per_token / (best[lm_head.name] * 1e9),
        attn_s_per_flop=1.0 / (mean_layer_rate * 1e9),
        attn_flops_per_key=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers,
    )
    return ceiling, rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("peers_json", type=Path, help="the --out file of jobs.bench.peers")
    p.add_argument("--ceiling-tokens", default="64,256,512", help="matmul M values to time")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    run: dict[str, Any] = json.loads(args.peers_json.read_text())
    run_args = argparse.Namespace(**run["args"])
    source = resolve_model_source(run_args.model)
    tokenizer, vocab = load_tokenizer(source), source.config.vocab_size
    workloads = {w.name: w for w in build_workloads(run_args, tokenizer, vocab)}
    tokens = [int(m) for m in args.ceiling_tokens.split(",")]
    rows, results = [], []
    for dtype in run_args.dtypes.split(","):
        ceiling, _ = measure_matmul_ceiling(source.config, tokens, getattr(torch, dtype))
        log(f"{dtype} matmul ceiling measured")
        for r in run["results"]:
            if r["dtype"] == dtype and r["workload"] in workloads:
                w = workloads[r["workload"]]
                bound = w.output_tokens / ceiling.workload_seconds(w)
                share = r["output_tok_s"] / bound
                results.append(dict(r, bound_tok_s=bound, ceiling_share=share))
                rows.append([dtype, r["workload"], r["system"], f"{r['output_tok_s']:.1f}",
                             f"{bound:.1f}", f"{share:.1%}"])  # fmt: skip
    env = environment()
    print(f"## Share of the matmul ceiling ({env['date_utc']}), CPU {env['cpu']}\n")
    header = ["dtype", "workload", "system", "output tok/s", "matmul bound tok/s", "share"]
    print(markdown_table(header, rows))
    if args.out:
        save_results(args.out, env, results)


if __name__ == "__main__":
    main()
