"""Pooling jobs under executor=ray (2 replicas on a local Ray instance): embed, classify and
score give the local job's completions.parquet, and a replica killed mid-job costs no row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from batchpage.job import run_job
from tests.engine.test_pooling import pooling_config, randomize, save_with_tokenizer
from tests.executor.jobs import job, job_args, ray_args, run_json, shard_indices, write_rows
from tests.executor.test_ray_executor import KillsReplicaZero

# cached_tokens depends on which replica held which prefix; every other column must match.
IGNORED = {"cached_tokens"}


@pytest.fixture(scope="module")
def scorers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ray_pooling")
    labels = {0: "bad", 1: "fine", 2: "good"}
    cls = AutoModelForSequenceClassification.from_config(
        pooling_config("llama_gqa_tied", id2label=labels, label2id={})
    )
    cross = AutoModelForSequenceClassification.from_config(
        pooling_config("qwen3_tied", num_labels=1)
    )
    return {
        "classify": save_with_tokenizer(randomize(cls, 1), root / "classify"),
        "score": save_with_tokenizer(randomize(cross, 2), root / "score"),
    }


def table(out: Path) -> list[dict[str, Any]]:
    rows = pq.read_table(out / "completions.parquet").to_pylist()
    return [{k: v for k, v in r.items() if k not in IGNORED} for r in rows]


def assert_same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Every column equal, the pooled values within float32 rounding: a row's batch mates
    differ between replicas, and with them the kernels' summation order."""
    values = ("embedding", "probs", "score")
    assert [{k: v for k, v in r.items() if k not in values} for r in got] == [
        {k: v for k, v in r.items() if k not in values} for r in want
    ]
    for a, b in zip(got, want, strict=True):
        for name in values:
            if name in a and a[name] is not None:
                torch.testing.assert_close(
                    torch.tensor(a[name]), torch.tensor(b[name]), atol=1e-5, rtol=0
                )
            elif name in a:
                assert b[name] is None


def pooling_args(task: str, folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    args = job_args(data, folder, out, f"engine.task={task}", *extra)
    if task == "score":  # each prompt against the next row's, made a column of its own
        args.append("dataset.response_column=doc")
    return args


def write_pairs(path: Path, count: int) -> Path:
    """write_rows' prompts (errors included) with a `doc` column: the prompt, reworded."""
    import json

    rows = [json.loads(line) for line in write_rows(path, count).read_text().splitlines()]
    for i, r in enumerate(rows):
        r["doc"] = f"Document {i} about {r['prompt'][-12:]}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("task", ["embed", "classify", "score"])
def test_pooling_jobs_on_two_replicas_equal_the_local_job(
    tmp_path, tiny_folder, scorers, task: str, ray_instance
) -> None:
    folder = tiny_folder if task == "embed" else scorers[task]  # a causal LM embeds too
    data = write_pairs(tmp_path / "d.jsonl", 14)
    run_job(job(pooling_args(task, folder, data, tmp_path / "local")))
    run_job(job(pooling_args(task, folder, data, tmp_path / "ray", *ray_args())))
    local, ray = table(tmp_path / "local"), table(tmp_path / "ray")
    assert_same_rows(ray, local)
    assert [r["index"] for r in ray if r["error"] is not None] == [1, 4, 7]  # as write_rows says
    column = {"embed": "embedding", "classify": "label", "score": "score"}[task]
    assert all(r[column] is not None for r in ray if r["error"] is None)
    executor = run_json(tmp_path / "ray")["runs"][-1]["settings"]["executor"]
    assert executor["kind"] == "ray" and all(r["windows"] >= 1 for r in executor["replicas"])


@pytest.mark.slow
def test_a_replica_killed_mid_embedding_job_costs_no_row(
    tmp_path, tiny_folder, ray_instance
) -> None:
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    args = pooling_args("embed", tiny_folder, data, tmp_path / "ray", "flush_rows=2", *ray_args())
    cfg = job(args)
    run_job(cfg, lambda model, **engine: KillsReplicaZero(model, cfg.executor, **engine))
    assert sorted(shard_indices(tmp_path / "ray")) == list(range(24)), "a row lost or doubled"
    executor = run_json(tmp_path / "ray")["runs"][-1]["settings"]["executor"]
    assert executor["replicas_lost"] == 1 and executor["rows_requeued"] >= 1
    run_job(job(pooling_args("embed", tiny_folder, data, tmp_path / "local")))
    assert_same_rows(table(tmp_path / "ray"), table(tmp_path / "local"))
