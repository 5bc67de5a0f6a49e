"""Tensor parallelism against one rank: decode steps of R running sequences, taking turns.

    python -m jobs.bench.tensor_parallel --model $(python -m jobs.bench.random_models 1b) \\
        --running 8,64 --steps 16 --runs 3
    python -m jobs.bench.tensor_parallel --smoke

Each side is an engine loaded after the last is freed, its --runs back to back: tensor_parallel_size
1 with every torch thread of this process, and each of --worlds, whose ranks share the host's
cores (a thread each on two cores). Per side and R: the median decode step (over every step of
every run), rank 0's forward part of it (the step message, its forward, its all-reduces) and
the time it spends inside the all-reduces (the wire's latency and the wait for the slowest
rank), and for N > 1 ranks the step message rank 0 broadcasts to the others: its bytes and the
milliseconds the broadcast took, per step, read from the engine's workers. The same
greedy tokens on every side are counted too (float32: the all-reduce changes only the order of
a sum).
"""

from __future__ import annotations

import datetime
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchpage import SamplingParams
from batchpage.model.loader import resolve_model_source
from batchpage.ops.collective import Collective, GroupCollective
from batchpage.ops.shm_collective import shared_memory_collective
from jobs.bench.engine_runs import load_llm, parse_options
from jobs.bench.random_models import random_model_folder
from jobs.bench.report import (
    environment,
    fmt,
    ints,
    log,
    markdown_table,
    parser,
    print_header,
    save_results,
)


def prompts_for(running: int, vocab: int) -> list[list[int]]:
    return [[(7 * r + 3 * i) % (vocab - 10) + 5 for i in range(16 + r % 8)] for r in range(running)]


def run_side(model: str, world: int, running: int, args: Any, vocab: int) -> dict[str, Any]:
    options = dict(
        dtype=args.dtype,
        tensor_parallel_size=world,
        max_num_seqs=running,
        max_num_batched_tokens=running * 24,
        kv_cache_memory=args.kv_cache_mib << 20,
        **parse_options(args.both, "--both"),
    )
    llm = load_llm(model, f"TP={world}", **options)
    prompts = prompts_for(running, vocab)
    steps, tokens, sent = [], None, []
    peers = llm.engine.runner.peers
    forward, reduce, reduces = [], [], []
    for run in range(args.runs):
        before = (
            None if peers is None else (peers.sent.messages, peers.sent.bytes, peers.sent.seconds)
        )
        with ReduceClock(None if peers is None else type(peers.comm)) as clock:
            result = decode_parts(llm, prompts, args.steps, clock)
        steps += result["step_s"]
        forward += result["forward_s"]
        reduce += result["reduce_s"]
        reduces += result["reduces"]
        tokens = result["tokens"]
        if peers is not None and before is not None:
            n = peers.sent.messages - before[0]
            sent.append(((peers.sent.bytes - before[1]) / n, (peers.sent.seconds - before[2]) / n))
        log(f"TP={world} R={running} run {run}: {statistics.median(result['step_s']) * 1e3:.2f} ms")
    return {
        "world": world,
        "running": running,
        "step_ms": statistics.median(steps) * 1e3,
        "message_bytes": statistics.median(b for b, _ in sent) if sent else None,
        "message_ms": statistics.median(s for _, s in sent) * 1e3 if sent else None,
        "forward_ms": statistics.median(forward) * 1e3,
        "in_all_reduce_ms": statistics.median(reduce) * 1e3,
        "all_reduces": statistics.median(reduces),
        "tokens": tokens,
    }


class ReduceClock:
    """Rank 0's time inside the group's all-reduces (the wire's latency and the wait for the
    slowest rank), while in a `with` block: the all_reduce_ of `kind`, rank 0's collective's
    class (gloo's or shared memory's), timed in this process."""

    def __init__(self, kind: type[Collective] | None) -> None:
        self.kind = kind
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> ReduceClock:
        if self.kind is None:  # one rank: nothing to time
            return self
        self.plain = self.kind.all_reduce_
        clock = self

        def timed(group: Collective, x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = clock.plain(group, x)
            clock.seconds += time.perf_counter() - start
            clock.calls += 1
            return out

        self.kind.all_reduce_ = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.kind is not None:
            self.kind.all_reduce_ = self.plain  # type: ignore[method-assign]


def decode_parts(llm: Any, prompts: list[list[int]], steps: int, clock: ReduceClock) -> dict:
    """decode_steps' pure decode steps, with rank 0's forward part (the step message, its
    forward and its all-reduces) and its time inside the all-reduces, per step."""
    marks: list[tuple[float, int, int, float, float, int]] = []

    def on_step(stats: Any) -> None:
        marks.append((time.perf_counter(), stats.prefill_tokens_computed, stats.generated_tokens,
                      stats.step_time_s["forward"], clock.seconds, clock.calls))  # fmt: skip

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, on_step=on_step)
    pure = [(a, b) for a, b in zip(marks, marks[1:], strict=False)
            if b[1] == a[1] and b[2] - a[2] == len(prompts)]  # fmt: skip
    return {
        "step_s": [b[0] - a[0] for a, b in pure],
        "forward_s": [b[3] - a[3] for a, b in pure],
        "reduce_s": [b[4] - a[4] for a, b in pure],
        "reduces": [b[5] - a[5] for a, b in pure],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def _time_all_reduce(rank: int, port: int, shapes: list[tuple[int, int]], out: Any) -> None:
    """One rank of two: the median seconds of an all-reduce of each shape over gloo and through
    the shared-memory segment (the collective a tensor-parallel forward runs twice a layer)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    ways = [GroupCollective(group, 2),
            shared_memory_collective(store, group, rank, 2, torch.device("cpu"))]  # fmt: skip
    medians = []
    for shape in shapes:
        x = torch.randn(shape)
        pair = []
        for comm in ways:
            samples = []
            for _ in range(40):
                start = time.perf_counter()
                comm.all_reduce_(x)
                samples.append(time.perf_counter() - start)
            pair.append(statistics.median(samples[5:]))
        medians.append(pair)
    if rank == 0:
        out.put(medians)


def all_reduce_ms(hidden: int, running: list[int]) -> list[list[float]]:
    """Milliseconds of one all-reduce of [R, hidden] float32 between two processes: gloo's,
    shared memory's."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shapes = [(r, hidden) for r in running]
    procs = [ctx.Process(target=_time_all_reduce, args=(r, port, shapes, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    medians = queue.get(timeout=300)
    for p in procs:
        p.join()
    return [[m * 1e3 for m in pair] for pair in medians]


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--model", default=None, help="default: the tiny random model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--worlds", type=ints, default=[2])
    p.add_argument("--running", type=ints, default=[8, 64])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument("--both", nargs="*", default=[], metavar="KEY=VALUE",
                   help="engine options for every side, e.g. quantized_weights=true")  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.running, args.steps, args.runs, args.kv_cache_mib = [4], 3, 1, 32
    model = args.model or str(random_model_folder("tiny"))
    vocab = resolve_model_source(model).config.vocab_size
    env = environment()
    results = []
    for running in args.running:
        for world in [1, *args.worlds]:
            results.append(run_side(model, world, running, args, vocab))
    rows = []
    for r in results:
        base = next(b for b in results if b["running"] == r["running"] and b["world"] == 1)
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
        rows.append([
            r["world"], r["running"], fmt(r["step_ms"], 2), fmt(base["step_ms"] / r["step_ms"], 2),
            fmt(r["forward_ms"], 2), fmt(r["in_all_reduce_ms"], 2), fmt(r["all_reduces"], 0),
            "-" if r["message_bytes"] is None else f"{r['message_bytes']:,.0f}",
            "-" if r["message_ms"] is None else fmt(r["message_ms"], 3),
            f"{same}/{len(r['tokens'])}",
        ])  # fmt: skip
    print_header("Tensor parallelism: decode steps against one rank", env, f"model {model}")
    headers = ["ranks", "running", "step ms", "TP=1 / this", "rank 0 forward ms",
               "in all-reduces ms", "all-reduces", "message bytes", "message ms",
               "same"]  # fmt: skip
    print(markdown_table(headers, rows))
    cfg = resolve_model_source(model).config
    reduce_ms = all_reduce_ms(cfg.hidden_size, args.running)
    per_step = 2 * cfg.num_layers + 1  # each layer's two, and the embedding's
    print(f"\nAll-reduce of [R, {cfg.hidden_size}] float32 between two processes:\n")
    print(markdown_table(
        ["running", "gloo ms", f"x {per_step} a step, ms", "shared memory ms",
         f"x {per_step} a step, ms"],
        [[r, fmt(g, 3), fmt(g * per_step, 1), fmt(m, 3), fmt(m * per_step, 1)]
         for r, (g, m) in zip(args.running, reduce_ms, strict=True)],
    ))  # fmt: skip
    for r, (g, m) in zip(args.running, reduce_ms, strict=True):
        results.append({"running": r, "all_reduce_ms": g, "shm_all_reduce_ms": m,
                        "all_reduces_a_step": per_step})  # fmt: skip
    for r in results:
        r.pop("tokens", None)
    save_results(args.out, env, results, args)


if __name__ == "__main__":
    main()
