"""The model's linears on this CPU: F.linear against oneDNN's prepacked OneDnnLinear and
batchpage's own kernel for the dtype (in float32 its float32 kernel, F32KernelLinear; in
bfloat16 on a CPU with AVX512-BF16 its bf16 kernel, Bf16DotLinear; all engine paths,
batchpage/ops), at the row counts a step has.

    python -m jobs.bench.linears                       # SmolLM2's shapes, float32
    python -m jobs.bench.linears --dtype bfloat16 --rows 64,256 \
        --out jobs/bench/results/linears.json

Each cell is the median of --repeats calls after a warm-up; a layer's time sums its linears (k
and v, gate and up counted as the engine runs them: one merged matmul each). Prints Markdown
and the command; --out writes JSON with the CPU model and flags.

Repeating one call keeps its weight in the caches, which a decode step never does: between two
uses of a layer's weight the step streams every other weight of the model. The "cold" column
runs oneDNN (and the kernel) over enough copies of each weight (together at least 128 MiB,
four times a large L3) taken in turn, so that every call reads its weight from memory, as in the
engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchpage.model.loader import resolve_model_source
from batchpage.ops.bf16_linear import Bf16DotLinear, bf16_dot_kernel
from batchpage.ops.f32_linear import F32KernelLinear, f32_kernel
from batchpage.ops.onednn_linear import OneDnnLinear, onednn_packs
from jobs.bench import report

LABELS = {"onednn": "oneDNN", "bf16_kernel": "bf16 kernel", "f32_kernel": "float32 kernel"}
KERNELS = ("bf16_kernel", "f32_kernel")
MAX_COPIES = 256  # a tiny model's weights stay cached anyway


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return report.in_turns({"": fn}, repeats)[""]


def merged_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, in, out) of one layer's matmuls as the engine runs them, then the lm_head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return [
        ("qkv_proj", h, q + 2 * kv),
        ("o_proj", q, h),
        ("gate_up_proj", h, 2 * inter),
        ("down_proj", inter, h),
        ("lm_head", h, cfg.vocab_size),
    ]


def ratios(times: dict) -> list[str]:
    """oneDNN's speedup over F.linear (weights hot, both), and batchpage's kernel's over oneDNN
    with weights streaming from memory, where it ran."""
    out = [f"{times['f_linear_ms'] / times['onednn_ms']:.2f}x"]
    for k in KERNELS:
        if f"{k}_cold_ms" in times:
            out.append(f"{times['onednn_cold_ms'] / times[f'{k}_cold_ms']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__, smoke=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", default="1,16,64,256,512")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not onednn_packs(dtype, torch.device("cpu")):
        p.error(f"oneDNN cannot pack {args.dtype} weights on this CPU: nothing to compare")
    cfg = resolve_model_source(args.model).config
    kernel = bf16_dot_kernel(dtype, torch.device("cpu"), required=False)
    makers: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
        "onednn": lambda w: OneDnnLinear(w, None)
    }
    if kernel is not None:
        makers["bf16_kernel"] = lambda w: Bf16DotLinear(w, None, kernel)
    f32 = f32_kernel(dtype, torch.device("cpu"), required=False)
    if f32 is not None:
        makers["f32_kernel"] = lambda w: F32KernelLinear(w, None, f32)
    own = next((k for k in KERNELS if k in makers), None)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    for m in report.ints(args.rows):
        layer: dict[str, float] = {}
        for name, d_in, d_out in merged_shapes(cfg):
            w = (torch.randn(d_out, d_in, generator=gen) * d_in**-0.5).to(dtype)
            x = torch.randn(m, d_in, generator=gen).to(dtype)
            copies = report.cold_copies(w.numel() * w.element_size(), MAX_COPIES)
            cell = dict(rows=m, linear=name, d_in=d_in, d_out=d_out)
            with torch.inference_mode():
                ref = F.linear(x, w).float()
                cell["f_linear_ms"] = _median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats)
                for path, make in makers.items():
                    packed = make(w)
                    cell[f"{path}_max_abs_diff"] = (packed(x).float() - ref).abs().max().item()
                    cell[f"{path}_ms"] = _median_ms(lambda x=x, p=packed: p(x), args.repeats)
                    turns = itertools.cycle([packed] + [make(w) for _ in range(copies - 1)])
                    cold = _median_ms(lambda x=x, t=turns: next(t)(x), args.repeats)
                    cell[f"{path}_cold_ms"] = cold
                    del turns
            results.append(cell)
            timed = [k for k in cell if k.endswith("_ms")]
            if name != "lm_head":
                for k in timed:
                    layer[k] = layer.get(k, 0.0) + cell[k]
            gflop = 2 * m * d_in * d_out / 1e9
            rows.append(
                [m, name, f"{d_in} x {d_out}"]
                + [f"{cell[k]:.3f} ({gflop / cell[k] * 1e3:.0f})" for k in timed]
                + ratios(cell)
                + [f"{cell[f'{p}_max_abs_diff']:.1e}" for p in makers]
            )
        rows.append(
            [m, "**one layer**", ""]
            + [f"{v:.3f}" for v in layer.values()]
            + ratios(layer)
            + ["" for _ in makers]
        )
        report.log(f"rows {m}: one layer " + ", ".join(f"{k} {v:.3f}" for k, v in layer.items()))
    env = report.environment()
    versus = f" vs the {LABELS[own]}" if own else ""
    report.print_header(f"Prepacked linears: F.linear vs oneDNN{versus}", env, f"{args.dtype}, "
                 f"{args.model}'s shapes, median of {args.repeats} calls")  # fmt: skip
    timings = ["F.linear"] + [f"{LABELS[p]}{c}" for p in makers for c in ("", " cold")]
    header = ["rows", "linear", "in x out"] + [f"{t} ms (GFLOP/s)" for t in timings]
    header += ["oneDNN vs F.linear"] + ([f"{LABELS[own]} vs oneDNN, cold"] if own else [])
    header += [f"{LABELS[p]} max abs diff" for p in makers]
    print(report.markdown_table(header, rows))
    report.save_results(args.out, env, results)


if __name__ == "__main__":
    main()
