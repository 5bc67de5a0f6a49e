"""The model's linears on this CPU: F.linear against oneDNN's prepacked PackedLinear (the engine's
CPU path, batchpage/model/packed_linear.py), at the row counts a step has.

    python -m jobs.bench.linears                       # SmolLM2's shapes, float32
    python -m jobs.bench.linears --dtype bfloat16 --rows 64,256 --out bench/linears.json

Each cell is the median of --repeats calls after a warm-up; a layer's time sums its linears (k
and v, gate and up counted as the engine runs them: one merged matmul each). Prints Markdown
and the command; --out writes JSON with the CPU model and flags.

Repeating one call keeps its weight in the caches, which a decode step never does: between two
uses of a layer's weight the step streams every other weight of the model. The "cold" column
runs oneDNN over enough copies of each weight (together at least 128 MiB, four times a large
L3) taken in turn, so that every call reads its weight from memory, as in the engine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from batchpage.model.loader import resolve_model_source
from batchpage.model.packed_linear import PackedLinear, onednn_packs
from jobs.bench.report import command_line, environment, log, markdown_table, write_json


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


COLD_BYTES = 128 * 2**20
MAX_COPIES = 256  # a tiny model's weights stay cached anyway


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rows", default="1,16,64,256,512")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not onednn_packs(dtype, torch.device("cpu")):
        p.error(f"oneDNN cannot pack {args.dtype} weights on this CPU: nothing to compare")
    cfg = resolve_model_source(args.model).config
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    for m in (int(r) for r in args.rows.split(",")):
        layer_plain = layer_packed = layer_cold = 0.0
        for name, d_in, d_out in merged_shapes(cfg):
            w = (torch.randn(d_out, d_in, generator=gen) * d_in**-0.5).to(dtype)
            x = torch.randn(m, d_in, generator=gen).to(dtype)
            packed = PackedLinear(w, None)
            copies = min(MAX_COPIES, -(-COLD_BYTES // (w.numel() * w.element_size())))
            turns = itertools.cycle([packed] + [PackedLinear(w, None) for _ in range(copies - 1)])
            with torch.inference_mode():
                err = (packed(x).float() - F.linear(x, w).float()).abs().max().item()
                plain_ms = median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats)
                packed_ms = median_ms(lambda x=x, p=packed: p(x), args.repeats)
                cold_ms = median_ms(lambda x=x, t=turns: next(t)(x), args.repeats)
            del turns
            gflop = 2 * m * d_in * d_out / 1e9
            results.append(
                dict(rows=m, linear=name, d_in=d_in, d_out=d_out, f_linear_ms=plain_ms,
                     onednn_ms=packed_ms, onednn_cold_ms=cold_ms, max_abs_diff=err)
            )  # fmt: skip
            if name != "lm_head":
                layer_plain += plain_ms
                layer_packed += packed_ms
                layer_cold += cold_ms
            rows.append(
                [m, name, f"{d_in} x {d_out}", f"{plain_ms:.3f}", f"{packed_ms:.3f}",
                 f"{cold_ms:.3f}", f"{gflop / plain_ms * 1e3:.0f}",
                 f"{gflop / packed_ms * 1e3:.0f}", f"{gflop / cold_ms * 1e3:.0f}",
                 f"{plain_ms / packed_ms:.2f}x", f"{err:.1e}"]
            )  # fmt: skip
        rows.append(
            [m, "**one layer**", "", f"{layer_plain:.3f}", f"{layer_packed:.3f}",
             f"{layer_cold:.3f}", "", "", "", f"{layer_plain / layer_packed:.2f}x", ""]
        )  # fmt: skip
        log(f"rows {m}: one layer {layer_plain:.3f} -> {layer_packed:.3f} ms")
    env = environment()
    print(f"## Prepacked linears: F.linear vs oneDNN ({env['date_utc']})\n")
    print(f"`{command_line()}`\n")
    print(
        f"CPU: {env['cpu']} ({', '.join(env['cpu_flags'])}), {env['torch_threads']} threads, "
        f"{args.dtype}, {args.model}'s shapes, median of {args.repeats} calls.\n"
    )
    print(
        markdown_table(
            [
                "rows",
                "linear",
                "in x out",
                "F.linear ms",
                "oneDNN ms",
                "oneDNN cold ms",
                "F.linear GFLOP/s",
                "oneDNN GFLOP/s",
                "oneDNN cold GFLOP/s",
                "speedup",
                "max abs diff",
            ],
            rows,
        )
    )
    if args.out:
        write_json(args.out, {"command": command_line(), "environment": env, "rows": results})


if __name__ == "__main__":
    main()
