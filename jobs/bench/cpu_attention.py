"""Decode attention on this CPU: the C++ paged-decode kernel against the torch backend.

    python -m jobs.bench.cpu_attention --out bench/cpu_attention.json
    python -m jobs.bench.cpu_attention --smoke         # seconds: does it run?

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, float32, block size 16):
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
"""

from __future__ import annotations

import argparse
import statistics
import time
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
from jobs.bench.report import command_line, environment, log, markdown_table, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_step(
    lens: list[int], pool_blocks: int, seed: int, shared_blocks: int = 0
) -> tuple[AttentionMetadata, KVCache]:
    """Metadata for one decode row per context and a one-layer pool of random K/V. The first
    shared_blocks blocks of every table are the same blocks (a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [blocks_for(n, BLOCK) for n in lens]
    assert all(nb > shared_blocks for nb in per_seq), "each row has a block of its own"
    own = sum(nb - shared_blocks for nb in per_seq)
    ids = torch.randperm(pool_blocks, generator=gen)[: shared_blocks + own].tolist()
    prefix, ids = ids[:shared_blocks], ids[shared_blocks:]
    tables, slots = [], []
    for n, nb in zip(lens, per_seq, strict=True):
        table, ids = prefix + ids[: nb - shared_blocks], ids[nb - shared_blocks :]
        tables.append(table + [0] * (max(per_seq) - nb))
        slots.append(table[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    kv = KVCache.allocate(1, pool_blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    kv.k[0].normal_(generator=gen)
    kv.v[0].normal_(generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=BLOCK,
        query_lens_cpu=(1,) * len(lens),
        seq_lens_cpu=tuple(lens),
    )
    return meta, kv


def time_backend(backend: Any, meta: AttentionMetadata, kv: KVCache, repeats: int) -> float:
    """Median seconds of one layer's attention call."""
    n = meta.num_seqs
    q = torch.randn(n, HEADS, HEAD_DIM)
    k = torch.randn(n, KV_HEADS, HEAD_DIM)
    v = torch.randn(n, KV_HEADS, HEAD_DIM)
    backend(0, q, k, v, kv, meta, HEAD_DIM**-0.5)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend(0, q, k, v, kv, meta, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.contexts, args.spread, args.shared = "8", "40", "10,60", "4,40,32"
        args.pool_gib, args.repeats = 0.02, 2
    torch.set_num_threads(torch.get_num_threads())
    keep_freed_memory()  # as the engine does on a CPU
    kernel = CpuPagedDecode.build()
    token_bytes = bytes_per_block(1, 1, KV_HEADS, HEAD_DIM, torch.float32)  # one token, one layer
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
    for i, (label, lens, shared_blocks) in enumerate(cases):
        meta, kv = decode_step(
            lens, max(pool_blocks, 2 * sum(blocks_for(n, BLOCK) for n in lens)), i, shared_blocks
        )
        t_torch = time_backend(TorchPagedAttention().plan(meta), meta, kv, args.repeats)
        t_cpu = time_backend(CpuPagedAttention(kernel).plan(meta), meta, kv, args.repeats)
        gbytes = sum(lens) * token_bytes / 1e9
        result = {
            "case": label, "torch_ms": t_torch * 1e3, "cpu_ms": t_cpu * 1e3,
            "torch_gb_s": gbytes / t_torch, "cpu_gb_s": gbytes / t_cpu,
            "speedup": t_torch / t_cpu,
        }  # fmt: skip
        results.append(result)
        rows.append([
            label, result["torch_ms"], result["cpu_ms"], result["torch_gb_s"],
            result["cpu_gb_s"], f"{result['speedup']:.2f}x",
        ])  # fmt: skip
        log(f"{label}: torch {t_torch * 1e3:.2f} ms, cpu kernel {t_cpu * 1e3:.2f} ms")
        del kv

    env = environment()
    print(f"## CPU decode attention: C++ kernel vs torch backend ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(
        f"One layer, {HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, float32, block "
        f"{BLOCK}, contexts in shuffled blocks of a {args.pool_gib:g} GiB pool, "
        f"{env['torch_threads']} threads, median of {args.repeats}. CPU: {env['cpu']} "
        f"({', '.join(env['cpu_flags'])}). GB/s counts each row's context once, so a shared "
        "prefix, read from the caches, can exceed the memory's bandwidth.\n"
    )
    print(
        markdown_table(
            ["decode rows x context", "torch ms", "cpu kernel ms", "torch GB/s",
             "cpu kernel GB/s", "speedup"],
            rows,
        )
    )  # fmt: skip
    if args.out:
        write_json(args.out, {"command": command_line(), "environment": env, "results": results})
        print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
