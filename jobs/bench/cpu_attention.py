"""Decode attention on this CPU: the C++ paged-decode kernel against the torch backend.

    python -m jobs.bench.cpu_attention --out bench/cpu_attention.json
    python -m jobs.bench.cpu_attention --smoke         # seconds: does it run?

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, block size 16; float32,
or --dtype bfloat16):
a batch of decode rows whose contexts sit in shuffled blocks of a pool much larger than the
caches, so every read comes from memory as in the engine. Each row is timed through the
AttentionBackend interface (K/V write of the new token included) for:

- `torch`: TorchPagedAttention, which gathers every context out of the pool, then runs SDPA;
- `cpu`: CpuPagedAttention, whose C++ kernel reads the blocks in place.

Three length patterns: every context the same length; lengths spread evenly over a range and
listed longest first, as the scheduler lists its oldest sequences first; and (--shared) rows
whose contexts start with the same cached blocks, as behind a shared system prompt, where the
reads come from the caches and the kernel's arithmetic sets its speed. "GB/s" is the K/V bytes
the contexts hold, per second: the traffic a kernel that reads each byte once must move.

Each case is laid out several times over disjoint blocks (together at least 128 MiB, four times
a large L3) and every call takes the next copy, so no call finds the blocks that the last ones
left in the caches. The systems take turns call by call, so a busy moment of a shared machine
falls on all of them alike.

    git show HEAD~1:kernels/cpu_paged_decode.cpp > /tmp/before.cpp
    python -m jobs.bench.cpu_attention --baseline /tmp/before.cpp

--baseline builds a second copy of the kernel from another source (an older version) and times
it in the same turns: the fair way to see what a change to the kernel did on a noisy machine.
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
from batchpage.engine.kv_manager import blocks_for
from batchpage.host_memory import keep_freed_memory
from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
from jobs.bench.report import command_line, environment, log, markdown_table, timed, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


COLD_BYTES = 128 * 2**20  # the copies of a case together: four times a 32 MiB L3


def decode_metas(
    lens: list[int], pool_blocks: int, gen: torch.Generator, shared_blocks: int, copies: int
) -> list[AttentionMetadata]:
    """`copies` decode steps with one row per context, each over its own blocks of the pool.
    The first shared_blocks blocks of every table in one copy are the same blocks (a cached
    prefix)."""
    per_seq = [blocks_for(n, BLOCK) for n in lens]
    assert all(nb > shared_blocks for nb in per_seq), "each row has a block of its own"
    need = shared_blocks + sum(nb - shared_blocks for nb in per_seq)
    pool_ids = torch.randperm(pool_blocks, generator=gen)[: copies * need].tolist()
    metas = []
    for c in range(copies):
        ids = pool_ids[c * need : (c + 1) * need]
        prefix, ids = ids[:shared_blocks], ids[shared_blocks:]
        tables, slots = [], []
        for n, nb in zip(lens, per_seq, strict=True):
            table, ids = prefix + ids[: nb - shared_blocks], ids[nb - shared_blocks :]
            tables.append(table + [0] * (max(per_seq) - nb))
            slots.append(table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
        metas.append(
            AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long),
                query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                seq_lens=torch.tensor(lens, dtype=torch.int32),
                block_tables=torch.tensor(tables, dtype=torch.int32),
                block_size=BLOCK,
                query_lens_cpu=(1,) * len(lens),
                seq_lens_cpu=tuple(lens),
            )
        )
    return metas


def time_systems(
    systems: dict[str, Callable[[], Any]],
    metas: list[AttentionMetadata],
    kv: KVCache,
    repeats: int,
) -> dict[str, float]:
    """Median seconds of one layer's attention call for each system (a backend factory). Each
    repeat runs every system once, in an order that rotates; each call takes the next copy."""
    n = metas[0].num_seqs
    dtype = kv.k[0].dtype
    q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype)
    planned = {name: [make().plan(m) for m in metas] for name, make in systems.items()}
    names = list(systems)
    for name in names:  # warm-up
        planned[name][0](0, q, k, v, kv, metas[0], HEAD_DIM**-0.5)
    times: dict[str, list[float]] = {name: [] for name in names}
    calls = 0
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            c = calls % len(metas)
            start = time.perf_counter()
            planned[name][c](0, q, k, v, kv, metas[c], HEAD_DIM**-0.5)
            times[name].append(time.perf_counter() - start)
            calls += 1
    return {name: statistics.median(t) for name, t in times.items()}


def streaming_read_gb_s(gib: float, repeats: int = 5) -> float:
    """This machine's memory bandwidth for a plain read on torch's threads: the best of a few
    sums over a tensor much larger than the caches. The kernel's GB/s compares with it."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(timed(x.sum)[1] for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--contexts", default="128,512", help="uniform context lengths")
    p.add_argument("--spread", default="70,620", help="lo,hi of the longest-first pattern")
    p.add_argument(
        "--shared", default="48,580,544",
        help="rows,context,prefix: rows whose contexts start with the same cached prefix",
    )  # fmt: skip
    p.add_argument("--pool-gib", type=float, default=2.0, help="size of the one-layer pool")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--baseline", type=Path, default=None,
        help="C++ source of another version of the kernel, timed in turn with this one",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
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
        before = CpuPagedDecode.build(source=args.baseline.resolve())
        systems["baseline"] = lambda: CpuPagedAttention(before, prefill)
    dtype = getattr(torch, args.dtype)
    token_bytes = bytes_per_block(1, 1, KV_HEADS, HEAD_DIM, dtype)  # one token, one layer
    pool_blocks = int(args.pool_gib * 2**30 / (BLOCK * token_bytes))
    lo, hi = (int(x) for x in args.spread.split(","))
    cases: list[tuple[str, list[int], int]] = []  # (label, context lengths, shared blocks)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            cases.append((f"{b} x {ctx}", [ctx] * b, 0))
        spread = torch.linspace(hi, lo, b).round().int().tolist()
        cases.append((f"{b} x {lo}..{hi}, longest first", spread, 0))
    if args.shared:
        rows_, ctx, prefix = (int(x) for x in args.shared.split(","))
        label = f"{rows_} x {ctx}, first {prefix} shared (cached)"
        cases.append((label, [ctx] * rows_, prefix // BLOCK))

    rows, results = [], []
    gen = torch.Generator().manual_seed(0)
    for label, lens, shared_blocks in cases:
        need = sum(blocks_for(n, BLOCK) for n in lens)
        case_bytes = sum(lens) * token_bytes
        blocks = max(pool_blocks, 2 * need)
        copies = min(blocks // need, -(-COLD_BYTES // case_bytes))
        kv = KVCache.allocate(1, blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, "cpu")
        kv.k[0].normal_(generator=gen)
        kv.v[0].normal_(generator=gen)
        metas = decode_metas(lens, blocks, gen, shared_blocks, copies)
        t = time_systems(systems, metas, kv, args.repeats)
        gbytes = case_bytes / 1e9
        result = {
            "case": label, "copies": copies, "torch_ms": t["torch"] * 1e3,
            "cpu_ms": t["cpu"] * 1e3, "torch_gb_s": gbytes / t["torch"],
            "cpu_gb_s": gbytes / t["cpu"], "speedup": t["torch"] / t["cpu"],
        }  # fmt: skip
        row = [label, result["torch_ms"], result["cpu_ms"], result["torch_gb_s"],
               result["cpu_gb_s"], f"{result['speedup']:.2f}x"]  # fmt: skip
        if "baseline" in t:
            result["baseline_ms"] = t["baseline"] * 1e3
            result["vs_baseline"] = t["baseline"] / t["cpu"]
            row += [result["baseline_ms"], f"{result['vs_baseline']:.2f}x"]
        results.append(result)
        rows.append(row)
        log(f"{label}: " + ", ".join(f"{name} {sec * 1e3:.2f} ms" for name, sec in t.items()))
        del kv

    stream = streaming_read_gb_s(0.125 if args.smoke else 1.0)
    env = environment()
    print(f"## CPU decode attention: C++ kernel vs torch backend ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(
        f"One layer, {HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {args.dtype}, block "
        f"{BLOCK}, contexts in shuffled blocks of a {args.pool_gib:g} GiB pool, "
        f"{env['torch_threads']} threads, median of {args.repeats}, each call on blocks "
        f"the calls before it left alone. CPU: {env['cpu']} "
        f"({', '.join(env['cpu_flags'])}). GB/s counts each row's context once, so a shared "
        "prefix, read from the caches, can exceed the memory's bandwidth: a plain read of "
        f"1 GiB (tensor.sum()) runs at {stream:.1f} GB/s here.\n"
    )
    header = ["decode rows x context", "torch ms", "cpu kernel ms", "torch GB/s",
              "cpu kernel GB/s", "speedup"]  # fmt: skip
    if args.baseline:
        print(f"Baseline: the kernel built from {args.baseline}.\n")
        header += ["baseline kernel ms", "kernel vs baseline"]
    print(markdown_table(header, rows))
    if args.out:
        write_json(
            args.out,
            {"command": command_line(), "environment": env, "streaming_read_gb_s": stream,
             "results": results},
        )  # fmt: skip
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
