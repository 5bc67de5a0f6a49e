"""Small jobs on the tiny model, and how to compare their outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchpage.job.config import JobConfig
from batchpage.output import work_dir
from batchpage.run import compose_job

# cached_tokens depends on what ran alongside (and on which replica); everything else must match.
COMPARED = ["id", "index", "prompt", "completion", "finish_reason", "prompt_tokens", "error"]


def write_rows(path: Path, count: int, bad: bool = True) -> Path:
    """Prompts in shared-prefix groups, out of prefix order, and (bad=True) rows that must fail:
    empty, a bad per-row value, and one longer than max_model_len."""
    words = ["fox", "tree", "block", "cache", "world", "dog", "sum", "radix", "page"]
    records: list[dict[str, Any]] = [
        {"prompt": f"The quick brown {words[i % 9]} number {i}", "temperature": None}
        for i in range(count)
    ]
    if bad:
        records[1] = {"prompt": "", "temperature": None}
        records[4] = {"prompt": "A radix tree", "temperature": -1.0}
        records[7] = {"prompt": "The quick brown fox " * 80, "temperature": None}
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def job_args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"dataset.path={data}",
        f"model.path={model}",
        "engine.dtype=float32",
        # The torch reference attention: what is tested here is where rows go, not the kernel,
        # and each replica process would otherwise load (or first build) the C++ kernel.
        "engine.attention_backend=torch",
        "engine.kv_cache_memory=4194304",
        "engine.max_model_len=256",
        "sampling.max_tokens=6",
        "sampling.ignore_eos=true",
        f"output_dir={out}",
        "progress=false",
        *extra,
    ]


def ray_args(replicas: int = 2, window_rows: int = 3) -> list[str]:
    return [
        "executor=ray",
        f"executor.num_replicas={replicas}",
        f"executor.window_rows={window_rows}",
    ]


def job(args: list[str]) -> JobConfig:
    return compose_job(args)


def compared(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "completions.parquet", columns=COMPARED).to_pylist()


def shard_indices(out: Path) -> list[int]:
    return [
        i
        for s in work_dir(out).glob("shard-*.parquet")
        for i in pq.read_table(s)["index"].to_pylist()
    ]


def run_json(out: Path) -> dict[str, Any]:
    return json.loads((out / "run.json").read_text())
