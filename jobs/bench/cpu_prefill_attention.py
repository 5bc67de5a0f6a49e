"""Prefill attention on this CPU: a sequence's new rows through the paged-decode kernel (one
decode per row, over the pool in place) against SDPA over gathered blocks, and the backend's
rule that picks between them (attention/cpu_backend.py, `kernel_is_cheaper`).

    python -m jobs.bench.cpu_prefill_attention --out bench/cpu_prefill_attention.json
    python -m jobs.bench.cpu_prefill_attention --smoke      # seconds: does it run?

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, block size 16), timed
through the AttentionBackend interface (the new tokens' K/V writes included) as
CpuPagedAttention with prefill_in_kernel=True ("kernel"), False ("sdpa") and None ("rule"). The
cases: fresh prompts (causal: each row sees its own prefix), short prompts behind a cached
prefix, and chunks of a long prompt behind a long context. The systems take turns call by call,
so a busy moment of a shared machine falls on all of them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchpage.attention.cpu_backend import CpuPagedAttention, kernel_is_cheaper
from batchpage.cache.kv_cache import KVCache
from batchpage.host_memory import keep_freed_memory
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.testing import make_paged_case
from jobs.bench.report import command_line, environment, log, print_results
from tests.attention.case_inputs import case_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SYSTEMS = {"kernel": True, "sdpa": False, "rule": None}
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
    lens: list[int],
    new: list[int],
    shared: int,
    dtype: torch.dtype,
    repeats: int,
) -> tuple[dict[str, float], float]:
    """(median seconds of each system's call, the largest difference of its output from the
    kernel's)."""
    case = make_paged_case(lens, new, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, shared_blocks=shared)
    meta = case_metadata(case)
    kv = KVCache(k=[case.k_cache.nan_to_num()], v=[case.v_cache.nan_to_num()])
    args = (case.q, case.k_new, case.v_new, kv, meta, HEAD_DIM**-0.5)
    steps = {name: CpuPagedAttention(kernel, route).plan(meta) for name, route in SYSTEMS.items()}
    outs = {name: step(0, *args) for name, step in steps.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name](0, *args)
            times[name].append(time.perf_counter() - start)
    diff = max((o.float() - outs["kernel"].float()).abs().max().item() for o in outs.values())
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
    kernel = CpuPagedDecode.build()
    rows, results = [], []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for label, lens, new, shared in cases:
            t, diff = time_case(kernel, lens, new, shared, dtype, repeats)
            picks = {
                "kernel" if kernel_is_cheaper(n, c) else "sdpa"
                for n, c in zip(new, lens, strict=True)
            }
            result = {
                "dtype": dtype_name, "case": label, "max_abs_diff": diff,
                "rule_picks": ",".join(sorted(picks)),
                **{f"{name}_ms": sec * 1e3 for name, sec in t.items()},
                "kernel_vs_sdpa": t["sdpa"] / t["kernel"], "rule_vs_sdpa": t["sdpa"] / t["rule"],
            }  # fmt: skip
            results.append(result)
            rows.append([dtype_name, label, t["kernel"] * 1e3, t["sdpa"] * 1e3,
                         f"{result['kernel_vs_sdpa']:.2f}x", result["rule_picks"],
                         f"{result['rule_vs_sdpa']:.2f}x", f"{diff:.1e}"])  # fmt: skip
            timings = ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in t.items())
            log(f"{dtype_name} {label}: {timings}")
    env = environment()
    print(f"## CPU prefill attention: decode kernel vs SDPA ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(
        f"One layer, {HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, block {BLOCK}, "
        f"{env['torch_threads']} threads, median of {repeats} calls taken in turn. CPU: "
        f"{env['cpu']} ({', '.join(env['cpu_flags'])}).\n"
    )
    header = ["dtype", "new rows", "kernel ms", "sdpa ms", "kernel vs sdpa", "rule picks",
              "rule vs sdpa", "max abs diff"]  # fmt: skip
    print_results(header, rows, args.out, env, results)


if __name__ == "__main__":
    main()
