"""executor=ray with 1 and with N replicas on a shared-prefix job, against executor=local.

    python -m jobs.bench.ray_replicas --replicas 2 --out bench/ray_replicas.json
    python -m jobs.bench.ray_replicas --smoke            # a few rows: does it run?

The job: --rows chat rows, each a ShareGPT question behind one of --docs documents (long
ShareGPT replies, --doc-tokens tokens, in the system turn), shuffled, greedy, --max-tokens
output tokens with ignore_eos, on the bundled model. Each configuration runs the real job
(`python -m batchpage.run`'s run_job) into its own folder, with a local Ray instance of its own;
each replica gets 1 torch thread. The figures come from each run's run.json: output tok/s over
the time spent generating (model loads and Ray's start are left out; the job's wall time is
shown beside), the job's prefix hit rate, and each replica's rows/s and hit rate.

What a 2-core machine shows: that N replicas split the rows and keep each document's rows
together (the prefix hit rate stays near the 1-replica one), and the overhead of the driver and
Ray on throughput. It cannot show speedup from more hardware: replicas share the same cores
with each other and with other work. The scaling model below says what 8 replicas would do at
the measured per-replica rate, with the prefix cost that contiguous windows predict.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from batchpage.executor.windows import cut_windows, prefix_order
from batchpage.job import run_job
from batchpage.model.loader import load_tokenizer, resolve_model_source
from batchpage.run import compose_job
from jobs.bench.report import (
    command_line,
    environment,
    log,
    markdown_table,
    pct,
    write_json,
)
from jobs.bench.workloads import DOCUMENT_PROMPT, documents, short_sharegpt_questions


def write_dataset(path: Path, tokenizer: Any, rows: int, docs: int, doc_tokens: int) -> None:
    """Chat rows: one of `docs` documents in the system turn, then a distinct question."""
    texts = documents(tokenizer, docs, doc_tokens)
    pairs = [(q, i % docs) for i, q in enumerate(short_sharegpt_questions(tokenizer, rows))]
    random.Random(0).shuffle(pairs)
    with path.open("w") as f:
        for q, d in pairs:
            chat = [{"role": "system", "content": DOCUMENT_PROMPT + texts[d]},
                    {"role": "user", "content": q}]  # fmt: skip
            f.write(json.dumps({"messages": chat}) + "\n")


def run(data: Path, out: Path, args: argparse.Namespace, executor: list[str]) -> dict[str, Any]:
    overrides = [
        f"dataset.path={data}",
        "dataset.messages_column=messages",
        f"sampling.max_tokens={args.max_tokens}",
        "sampling.ignore_eos=true",
        "engine.max_model_len=1024",
        "engine.kv_cache_memory=268435456",
        f"output_dir={out}",
        "progress=false",
        *executor,
    ]
    result = run_job(compose_job(overrides))
    report = json.loads((out / "run.json").read_text())
    return {"wall_s": result.metrics["wall_s"], "run": report["runs"][-1]}


def predicted_hit_rate(prompts: list[list[int]], replicas: int, window_rows: int) -> float:
    """The prefix hit rate if each replica computes a shared prefix once: walk the windows in
    prefix order, dealt out as a work queue would (in turn), and count each full-block prefix
    a replica has not seen as computed."""
    order = prefix_order(prompts, "prefix")
    keys = [prompts[i] for i in order]
    seen: list[set[tuple[int, ...]]] = [set() for _ in range(replicas)]
    computed = total = 0
    block = 16
    for w, r in enumerate(cut_windows(keys, window_rows)):
        cache = seen[w % replicas]
        for key in keys[r.start : r.stop]:
            total += len(key)
            hit = 0
            for end in range(block, len(key), block):  # the last token is always computed
                if tuple(key[:end]) not in cache:
                    break
                hit = end
            computed += len(key) - hit
            cache.update(tuple(key[:end]) for end in range(block, len(key) + 1, block))
    return 1 - computed / total if total else 0.0


def totals_table(results: dict[str, dict[str, Any]]) -> str:
    base = results["ray x1"]["run"]["metrics"]["output_tokens_per_s"]
    rows = []
    for name, r in results.items():
        m = r["run"]["metrics"]
        tok_s = m["output_tokens_per_s"]
        hit = pct(m["prefix_hit_rate"])
        rows.append([name, tok_s, f"{tok_s / base:.2f}x", hit, m["prefill_tokens_computed"],
                     r["wall_s"]])  # fmt: skip
    headers = ["executor", "output tok/s", "vs ray x1", "prefix hit rate", "prefill computed"]
    return markdown_table([*headers, "job wall s"], rows)


def replicas_table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, r in results.items():
        for rep in r["run"]["settings"].get("executor", {}).get("replicas", []):
            rate = rep["rows"] / rep["elapsed_s"] if rep["elapsed_s"] else 0.0
            hit = pct(rep["prefix_hit_rate"])
            rows.append([name, rep["replica"], rep["windows"], rep["rows"], rate,
                         rep["output_tokens_per_s"], hit])  # fmt: skip
    headers = ["run", "replica", "windows", "rows", "rows/s (own time)", "output tok/s"]
    return markdown_table([*headers, "prefix hit rate"], rows)


def scaling_model(
    results: dict[str, dict[str, Any]], prompts: list[list[int]], args: argparse.Namespace
) -> list[list[Any]]:
    """8 replicas at the measured per-replica rate (rows over its own generating time), with
    the hit rate that contiguous windows predict (checked against the measured 1 and N)."""
    one = results["ray x1"]["run"]["settings"]["executor"]["replicas"][0]
    per_replica = one["rows"] / one["elapsed_s"]
    return [
        [k, predicted_hit_rate(prompts, k, args.window_rows), k * per_replica]
        for k in sorted({1, args.replicas, 8})
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--window-rows", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="8 rows, 2 documents, 4 tokens")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.docs, args.doc_tokens, args.max_tokens = 8, 2, 64, 4

    tokenizer = load_tokenizer(resolve_model_source("smollm2"))
    work = Path(tempfile.mkdtemp(prefix="ray_replicas_"))
    data = work / "rows.jsonl"
    write_dataset(data, tokenizer, args.rows, args.docs, args.doc_tokens)
    prompts = [
        tokenizer.apply_chat_template(json.loads(line)["messages"])
        for line in data.read_text().splitlines()
    ]
    ray = ["executor=ray", f"executor.window_rows={args.window_rows}"]
    configs = {
        "local": ["executor=local"],
        "ray x1": [*ray, "executor.num_replicas=1"],
        f"ray x{args.replicas}": [*ray, f"executor.num_replicas={args.replicas}"],
    }
    results: dict[str, dict[str, Any]] = {}
    for name, executor in configs.items():
        log(f"{name} ...")
        results[name] = run(data, work / name.replace(" ", "_"), args, executor)

    print(
        f"## Ray replicas: {args.rows} rows over {args.docs} documents of {args.doc_tokens} "
        f"tokens, {args.max_tokens} output tokens, windows of {args.window_rows} rows\n"
    )
    print(totals_table(results), end="\n\n")
    print(replicas_table(results), end="\n\n")
    model = scaling_model(results, prompts, args)
    print(
        markdown_table(
            ["replicas", "predicted prefix hit rate", "rows/s at the measured per-replica rate"],
            [[k, pct(h), r] for k, h, r in model],
        )
    )
    print(f"\ncommand: {command_line()}")
    if args.out:
        write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "env": environment(),
                              "results": results, "model": model})  # fmt: skip


if __name__ == "__main__":
    main()
