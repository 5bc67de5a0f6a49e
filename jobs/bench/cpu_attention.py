"""Attention on this CPU: the C++ kernels (CpuPagedAttention) against the torch backend, one
layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, block size 16), each call
through the AttentionBackend interface (the new tokens' K/V writes included).

    python -m jobs.bench.cpu_attention --out jobs/bench/results/cpu_attention.json
    python -m jobs.bench.cpu_attention --parts prefill --dtype bfloat16
    python -m jobs.bench.cpu_attention --smoke         # seconds: does it run?

decode: a batch of decode rows whose contexts sit in shuffled blocks of a pool much larger than
the caches, so every read comes from memory as in the engine. Three length patterns: every
context the same length; lengths spread over a range, longest first, as the scheduler lists its
oldest sequences first; and (--shared) rows whose contexts start with the same cached blocks, as
behind a shared system prompt, where the reads come from the caches. "GB/s" is the K/V bytes the
contexts hold, per second: the traffic a kernel that reads each byte once must move. Each case is
laid out several times over disjoint blocks (together at least 128 MiB, four times a large L3)
and every call takes the next copy, so no call finds the blocks the last ones left in the caches.

prefill: fresh prompts (each row sees its own prefix), short prompts behind a cached prefix and
chunks of a long prompt behind a long context, through the paged-prefill kernel; the torch
backend runs SDPA over the blocks it gathers.

The systems take turns call by call, so a busy moment of a shared machine falls on all of them
alike; medians are reported.

    git show HEAD~1:kernels/cpu_paged_decode.cpp > /tmp/before.cpp
    python -m jobs.bench.cpu_attention --baseline /tmp/before.cpp

--baseline builds a second decode kernel from another source (an older version) and times it in
the same turns: the fair way to see what a change to the kernel did on a noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from batchpage.attention.cpu_backend import CpuPagedAttention
from batchpage.attention.metadata import AttentionMetadata
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.cache.kv_cache import KVCache, bytes_per_block
from batchpage.host_memory import keep_freed_memory
from batchpage.kernels.cpu_build import build_extension
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from batchpage.kernels.testing import make_paged_case
from jobs.bench import report

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (label, context lengths, new tokens per sequence, leading blocks shared by all sequences)
PREFILL_CASES = [
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
SMOKE_PREFILL = [("2 prompts of 20", [20] * 2, [20] * 2, 0), ("chunk of 8 after 40", [48], [8], 0)]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def metadata(lens: list[int], new: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """One step's metadata: sequence b has lens[b] tokens, its last new[b] new this step."""
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, n, k in zip(tables, lens, new, strict=True)
             for p in range(n - k, n)]  # fmt: skip
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK,
        query_lens_cpu=tuple(new),
        seq_lens_cpu=tuple(lens),
    )


def decode_metas(
    lens: list[int], pool_blocks: int, gen: torch.Generator, shared_blocks: int, copies: int
) -> list[AttentionMetadata]:
    """`copies` decode steps with one row per context, each over its own blocks of the pool.
    The first shared_blocks blocks of every table in one copy are the same blocks (a cached
    prefix)."""
    per_seq = [blocks_for(n) for n in lens]
    assert all(nb > shared_blocks for nb in per_seq), "each row has a block of its own"
    need = shared_blocks + sum(nb - shared_blocks for nb in per_seq)
    pool_ids = torch.randperm(pool_blocks, generator=gen)[: copies * need].tolist()
    metas = []
    for c in range(copies):
        ids = pool_ids[c * need : (c + 1) * need]
        prefix, ids = ids[:shared_blocks], ids[shared_blocks:]
        tables = []
        for nb in per_seq:
            tables.append(prefix + ids[: nb - shared_blocks])
            ids = ids[nb - shared_blocks :]
        metas.append(metadata(lens, [1] * len(lens), tables))
    return metas


def time_systems(
    systems: dict[str, Callable[[], Any]], metas: list[AttentionMetadata], kv: KVCache, repeats: int
) -> tuple[dict[str, float], float]:
    """(median seconds of one layer's attention call for each system (a backend factory), the
    largest difference of any system's output from the first's). Each repeat runs every system
    once, in an order that rotates; each call takes the next copy of the step."""
    rows = metas[0].slot_mapping.numel()
    dtype = kv.k[0].dtype
    q = torch.randn(rows, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM).to(dtype)
    planned = {name: [make().plan(m) for m in metas] for name, make in systems.items()}
    names = list(systems)
    outs = [planned[n][0](0, q, k, v, kv, metas[0], HEAD_DIM**-0.5).float() for n in names]
    diff = max((o - outs[0]).abs().max().item() for o in outs)
    times: dict[str, list[float]] = {name: [] for name in names}
    calls = 0
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            c = calls % len(metas)
            start = time.perf_counter()
            planned[name][c](0, q, k, v, kv, metas[c], HEAD_DIM**-0.5)
            times[name].append(time.perf_counter() - start)
            calls += 1
    return {name: statistics.median(t) for name, t in times.items()}, diff


def streaming_read_gb_s(gib: float, repeats: int = 5) -> float:
    """This machine's memory bandwidth for a plain read on torch's threads: the best of a few
    sums over a tensor much larger than the caches. The kernel's GB/s compares with it."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(report.timed(x.sum)[1] for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def decode_cases(args: argparse.Namespace) -> list[tuple[str, list[int], int]]:
    """(label, context lengths, shared blocks) of every decode case."""
    lo, hi = report.ints(args.spread)
    cases = []
    for b in report.ints(args.batch_sizes):
        for ctx in report.ints(args.contexts):
            cases.append((f"{b} x {ctx}", [ctx] * b, 0))
        cases.append((f"{b} x {lo}..{hi}, longest first", torch.linspace(hi, lo, b).round().int()
                      .tolist(), 0))  # fmt: skip
    if args.shared:
        rows, ctx, prefix = report.ints(args.shared)
        cases.append((f"{rows} x {ctx}, first {prefix} shared (cached)", [ctx] * rows,
                      prefix // BLOCK))  # fmt: skip
    return cases


def run_decode(args, systems, dtype) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    token_bytes = bytes_per_block(1, 1, KV_HEADS, HEAD_DIM, dtype)  # one token, one layer
    pool_blocks = int(args.pool_gib * 2**30 / (BLOCK * token_bytes))
    gen = torch.Generator().manual_seed(0)
    results, rows = [], []
    for label, lens, shared_blocks in decode_cases(args):
        need = sum(blocks_for(n) for n in lens)
        case_bytes = sum(lens) * token_bytes
        blocks = max(pool_blocks, 2 * need)
        copies = report.cold_copies(case_bytes, blocks // need)
        kv = KVCache.allocate(1, blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu")
        kv.k[0].normal_(generator=gen)
        kv.v[0].normal_(generator=gen)
        t, _ = time_systems(systems, decode_metas(lens, blocks, gen, shared_blocks, copies), kv,
                            args.repeats)  # fmt: skip
        gb = case_bytes / 1e9
        result = {
            "kind": "decode", "case": label, "copies": copies, "torch_ms": t["torch"] * 1e3,
            "cpu_ms": t["cpu"] * 1e3, "torch_gb_s": gb / t["torch"], "cpu_gb_s": gb / t["cpu"],
            "speedup": t["torch"] / t["cpu"],
        }  # fmt: skip
        row = [label, result["torch_ms"], result["cpu_ms"], result["torch_gb_s"],
               result["cpu_gb_s"], f"{result['speedup']:.2f}x"]  # fmt: skip
        if "baseline" in t:
            result |= {"baseline_ms": t["baseline"] * 1e3, "vs_baseline": t["baseline"] / t["cpu"]}
            row += [result["baseline_ms"], f"{result['vs_baseline']:.2f}x"]
        results.append(result)
        rows.append(row)
        log_times(label, t)
    return results, rows


def log_times(label: str, times: dict[str, float]) -> None:
    report.log(f"{label}: " + ", ".join(f"{n} {sec * 1e3:.2f} ms" for n, sec in times.items()))


def run_prefill(args, systems, dtype) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    results, rows = [], []
    for label, lens, new, shared in SMOKE_PREFILL if args.smoke else PREFILL_CASES:
        case = make_paged_case(lens, new, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype,
                               shared_blocks=shared)  # fmt: skip
        kv = KVCache(k=[case.k_cache.nan_to_num()], v=[case.v_cache.nan_to_num()])
        tables = [t[: blocks_for(n)] for t, n in zip(case.block_table.tolist(), lens, strict=True)]
        meta = metadata(lens, new, tables)
        t, diff = time_systems({n: systems[n] for n in ("torch", "cpu")}, [meta], kv, args.repeats)
        result = {
            "kind": "prefill", "case": label, "torch_ms": t["torch"] * 1e3,
            "cpu_ms": t["cpu"] * 1e3, "speedup": t["torch"] / t["cpu"], "max_abs_diff": diff,
        }  # fmt: skip
        results.append(result)
        rows.append([label, result["torch_ms"], result["cpu_ms"], f"{result['speedup']:.2f}x",
                     f"{diff:.1e}"])  # fmt: skip
        log_times(label, t)
    return results, rows


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__)
    p.add_argument("--parts", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--batch-sizes", default="64,256", help="decode rows")
    p.add_argument("--contexts", default="128,512", help="uniform decode context lengths")
    p.add_argument("--spread", default="70,620", help="lo,hi of the longest-first pattern")
    p.add_argument(
        "--shared", default="48,580,544",
        help="rows,context,prefix: decode rows whose contexts start with the same cached prefix",
    )  # fmt: skip
    p.add_argument("--pool-gib", type=float, default=2.0, help="size of the one-layer pool")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--baseline", type=Path, default=None,
        help="C++ source of another version of the decode kernel, timed in turn with this one",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or not set(parts) <= {"decode", "prefill"}:
        p.error(f"--parts: decode, prefill or both; got {args.parts!r}")
    if args.smoke:
        args.batch_sizes, args.contexts, args.spread, args.shared = "8", "40", "10,60", "4,40,32"
        args.pool_gib, args.repeats = 0.02, 2
    torch.set_num_threads(torch.get_num_threads())
    keep_freed_memory()  # as the engine does on a CPU
    kernel, prefill = CpuPagedDecode.build(), CpuPagedPrefill.build()
    systems: dict[str, Callable[[], Any]] = {
        "torch": TorchPagedAttention,
        "cpu": lambda: CpuPagedAttention(kernel, prefill),
    }
    if args.baseline:
        path = args.baseline.resolve()
        before = CpuPagedDecode(build_extension(path, "baseline_cpu_decode", f"the kernel {path}"))
        systems["baseline"] = lambda: CpuPagedAttention(before, prefill)
    dtype = getattr(torch, args.dtype)
    env = report.environment()
    report.print_header("CPU attention: C++ kernels vs torch backend", env, f"one layer, {HEADS} "
                        f"query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {args.dtype}, block "
                        f"{BLOCK}, median of {args.repeats} calls taken in turn")  # fmt: skip
    results: list[dict[str, Any]] = []
    if "decode" in parts:
        found, rows = run_decode(args, systems, dtype)
        results += found
        stream = streaming_read_gb_s(0.125 if args.smoke else 1.0)
        print(f"Decode: contexts in shuffled blocks of a {args.pool_gib:g} GiB pool, each call on "
              "blocks the calls before it left alone. GB/s counts each row's context once, so a "
              "shared prefix, read from the caches, can exceed the memory's bandwidth: a plain "
              f"read of 1 GiB (tensor.sum()) runs at {stream:.1f} GB/s here.\n")  # fmt: skip
        header = ["decode rows x context", "torch ms", "cpu kernel ms", "torch GB/s",
                  "cpu kernel GB/s", "speedup"]  # fmt: skip
        if args.baseline:
            print(f"Baseline: the kernel built from {args.baseline}.\n")
            header += ["baseline kernel ms", "kernel vs baseline"]
        print(report.markdown_table(header, rows))
    if "prefill" in parts:
        found, rows = run_prefill(args, systems, dtype)
        results += found
        print("\nPrefill: the prefill kernel against SDPA over gathered blocks.\n")
        header = ["new rows", "torch ms", "cpu kernel ms", "speedup", "max abs diff"]
        print(report.markdown_table(header, rows))
    report.save_results(args.out, env, results)


if __name__ == "__main__":
    main()
