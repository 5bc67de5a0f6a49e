"""This CPU's matmul GFLOP/s at a Llama model's shapes, turned into an upper bound on tokens/s.

`measure_matmul_ceiling` times each linear of the model at step-sized token counts; `Ceiling`
turns the best rates into the least time a workload could take, so that an engine's throughput
can be reported as a fraction of what the machine allows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchpage.ops.bf16_linear import Bf16DotLinear, bf16_dot_kernel
from batchpage.ops.onednn_linear import OneDnnLinear, onednn_packs
from jobs.bench.report import timed
from jobs.bench.workloads import WorkloadRequest


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

    def decode_tokens_per_s(self, context: float) -> float:
        """Large-batch decode bound: every generated token costs the layers, the lm_head and
        attention over `context` keys."""
        attn = self.attn_flops_per_key * context * self.attn_s_per_flop
        return 1.0 / (self.layer_s_per_token + self.logits_s_per_token + attn)

    def workload_seconds(self, requests: Iterable[WorkloadRequest]) -> float:
        """Least time for the whole workload: each request runs its prompt and all but its last
        output token through the layers, samples output_len positions, and attends causally.
        Every prompt token is counted (a prefix cache could skip some)."""
        total = 0.0
        for r in requests:
            positions = len(r.prompt_token_ids) + r.output_len - 1
            keys = positions * (positions + 1) / 2  # causal: token i attends i keys
            total += positions * self.layer_s_per_token + r.output_len * self.logits_s_per_token
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


def model_flops_per_token(cfg: Any, with_logits: bool = True) -> int:
    """Linear FLOPs for one token through the model (2 x non-embedding linear params, plus the
    lm_head when that token's logits are computed)."""
    layer, lm_head = llama_shapes(cfg)
    flops = cfg.num_layers * sum(s.flops_per_token for s in layer)
    return flops + (lm_head.flops_per_token if with_logits else 0)
