"""A decoder layer's elementwise parts on this CPU: the C++ layer ops against the torch code
they replace in a CPU engine.

    python -m jobs.bench.layer_parts --out jobs/bench/results/cpu_layer_ops.json
    python -m jobs.bench.layer_parts --smoke         # seconds: does it run?

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 + 3 heads of 64 rotated; float32, or
--dtype bfloat16) at decode batch sizes. Each part is timed as the layer calls it, torch's
version from model/layers.py and model/rope.py, ours from kernels/cpu_layer_ops.py:
- `rms_norm`: the input norm;
- `add + rms_norm`: the residual add and the post-attention norm (torch: two calls);
- `silu * up`: the gated activation over the merged gate/up output;
- `rope`: q and k's heads, a slice of the qkv rows (ours rotates them in place);
- `argmax`: the greedy sampler's, over float32 logits of SmolLM2's vocabulary (49152), once a
  step rather than once a layer (not in the per-layer total).
Prints one Markdown table (microseconds per call, best of three runs) and a per-layer total.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.model.layers import RMSNorm
from batchpage.model.rope import apply_rope
from jobs.bench import report

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152
PER_STEP = ("argmax",)  # parts called once a step, not once a layer


def best_us(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call: the best of three runs of `calls` calls, after a warm-up."""
    for _ in range(max(3, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def parts(
    ops: CpuLayerOps, rows: int, dtype: torch.dtype
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """part -> (torch's call, ours), on random inputs of `rows` decode rows in `dtype` (rope's
    cos and sin stay float32, as the model makes them)."""
    gen = torch.Generator().manual_seed(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    norm = RMSNorm(HIDDEN, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    x, residual = randn(rows, HIDDEN), randn(rows, HIDDEN)
    gate_up = randn(rows, 2 * INTER)
    qkv = randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, HEADS + KV_HEADS, HEAD_DIM)
    angles = torch.rand(rows, 1, HEAD_DIM // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    logits = torch.randn(rows, VOCAB, generator=gen)

    def torch_silu() -> torch.Tensor:
        gate, up = gate_up.split(INTER, dim=-1)
        return F.silu(gate) * up

    return {
        "rms_norm": (lambda: norm(x), lambda: ops.rms_norm(x, norm.weight, norm.eps)),
        "add + rms_norm": (
            lambda: norm(x + residual),
            lambda: ops.add_rms_norm(x, residual, norm.weight, norm.eps),
        ),
        "silu * up": (torch_silu, lambda: ops.silu_mul(gate_up)),
        # Rotating the same rows again and again is fine for timing: only their values change.
        "rope": (lambda: apply_rope(qk, cos, sin), lambda: ops.rope_(qk, cos, sin)),
        "argmax": (lambda: logits.argmax(dim=-1), lambda: ops.argmax(logits)),
    }


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    p.add_argument("--rows", default="1,16,64,256", help="comma-separated decode rows")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    rows_list = [4] if args.smoke else report.ints(args.rows)
    calls = 5 if args.smoke else args.calls
    ops = CpuLayerOps.build()
    dtype = getattr(torch, args.dtype)
    results = []
    for rows in rows_list:
        for name, (theirs, ours) in parts(ops, rows, dtype).items():
            t_torch, t_ours = best_us(theirs, calls), best_us(ours, calls)
            results.append(
                {"rows": rows, "part": name, "dtype": args.dtype, "torch_us": t_torch,
                 "cpu_us": t_ours}
            )  # fmt: skip
            report.log(f"{rows} rows, {name}: torch {t_torch:.0f} us, C++ {t_ours:.0f} us")
    table = [
        [r["rows"], r["part"], r["torch_us"], r["cpu_us"], r["torch_us"] / r["cpu_us"]]
        for r in results
    ]
    for rows in rows_list:  # a layer calls each part once
        mine = [r for r in results if r["rows"] == rows and r["part"] not in PER_STEP]
        t_torch, t_ours = sum(r["torch_us"] for r in mine), sum(r["cpu_us"] for r in mine)
        table.append([rows, "**a layer's four**", t_torch, t_ours, t_torch / t_ours])
    env = report.environment()
    report.print_header("C++ layer ops vs torch", env, args.dtype)
    print(report.markdown_table(["rows", "part", "torch (us)", "C++ (us)", "speed-up"], table))
    report.save_results(args.out, env, results)


if __name__ == "__main__":
    main()
