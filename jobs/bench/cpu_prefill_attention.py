"""Prefill attention on this CPU, the three routes of the CPU backend (attention/cpu_backend.py,
`prefill_route`): a sequence's new rows through the paged-prefill kernel ("tiles": a tile of rows
reads each key once, in place), through the paged-decode kernel ("rows": one decode per row, in
place), and SDPA over gathered blocks ("sdpa").

    python -m jobs.bench.cpu_prefill_attention --out bench/cpu_prefill_attention.json
    python -m jobs.bench.cpu_prefill_attention --smoke      # seconds: does it run?

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, block size 16), timed
through the AttentionBackend interface (the new tokens' K/V writes included). The cases: fresh
prompts (causal: each row sees its own prefix), short prompts behind a cached prefix, and chunks
of a long prompt behind a long context. The routes take turns call by call, so a busy moment of
a shared machine falls on all of them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchpage.attention.cpu_backend import PREFILL_ROUTES, CpuPagedAttention
from batchpage.cache.kv_cache import KVCache
from batchpage.host_memory import keep_freed_memory
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from batchpage.kernels.testing import make_paged_case
from jobs.bench.report import command_line, environment, log, print_results
from tests.attention.case_inputs import case_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (label, context lengths, new tokens per sequence, leading blocks shared by all sequences)
CASES = [
    ("10 prompts of 67", [67] * 10, [67] * 10, 0),
    ("6 prompts of 108", [108] * 6, [108] * 6, 0),
    ("1 prompt of 256", [256], [256], 0),
    ("1 prompt of 1024", [1024], [1024], 0),
    ("1 prompt of 2048", [2048], [2048], 0),
    ("8 x 35 after a cached 555", [590] * 8, [35] * 8, 34),
    ("4 x 100 after a cached 800", [900] * 4, [100] * 4, 50),
    ("chunk of 64 after 4032", [4096], [64], 0),
    ("chunk of 512 after 3584", [4096], [512], 0),
]
SMOKE_CASES = [("2 prompts of 20", [20] * 2, [20] * 2, 0), ("chunk of 8 after 40", [48], [8], 0)]


def time_case(
    kernel: CpuPagedDecode,
    prefill: CpuPagedPrefill,
    lens: list[int],
    new: list[int],
    shared: int,
    dtype: torch.dtype,
    repeats: int,
) -> tuple[dict[str, float], float]:
    """(median seconds of each route's call, the largest difference of its output from the
    "rows" route's)."""
    case = make_paged_case(lens, new, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, shared_blocks=shared)
    meta = case_metadata(case)
    kv = KVCache(k=[case.k_cache.nan_to_num()], v=[case.v_cache.nan_to_num()])
    args = (case.q, case.k_new, case.v_new, kv, meta, HEAD_DIM**-0.5)
    steps = {r: CpuPagedAttention(kernel, prefill, r).plan(meta) for r in PREFILL_ROUTES}
    outs = {name: step(0, *args) for name, step in steps.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name](0, *args)
            times[name].append(time.perf_counter() - start)
    diff = max((o.float() - outs["rows"].float()).abs().max().item() for o in outs.values())
    return {name: statistics.median(t) for name, t in times.items()}, diff


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny cases: does it run?")
    args = p.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    repeats = 2 if args.smoke else args.repeats
    keep_freed_memory()  # as the engine does on a CPU
    kernel, prefill = CpuPagedDecode.build(), CpuPagedPrefill.build()
    rows, results = [], []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for label, lens, new, shared in cases:
            t, diff = time_case(kernel, prefill, lens, new, shared, dtype, repeats)
            result = {
                "dtype": dtype_name, "case": label, "max_abs_diff": diff,
                **{f"{name}_ms": sec * 1e3 for name, sec in t.items()},
                "tiles_vs_rows": t["rows"] / t["tiles"], "tiles_vs_sdpa": t["sdpa"] / t["tiles"],
            }  # fmt: skip
            results.append(result)
            rows.append([dtype_name, label, t["tiles"] * 1e3, t["rows"] * 1e3, t["sdpa"] * 1e3,
                         f"{result['tiles_vs_rows']:.2f}x", f"{result['tiles_vs_sdpa']:.2f}x",
                         f"{diff:.1e}"])  # fmt: skip
            timings = ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in t.items())
            log(f"{dtype_name} {label}: {timings}")
    env = environment()
    print(f"## CPU prefill attention: prefill kernel, decode kernel, SDPA ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(
        f"One layer, {HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK}, "
        f"{env['torch_threads']} threads, median of {repeats} calls taken in turn. CPU: "
        f"{env['cpu']} ({', '.join(env['cpu_flags'])}).\n"
    )
    header = ["dtype", "new rows", "tiles ms", "rows ms", "sdpa ms", "tiles vs rows",
              "tiles vs sdpa", "max abs diff"]  # fmt: skip
    print_results(header, rows, args.out, env, results)


if __name__ == "__main__":
    main()
