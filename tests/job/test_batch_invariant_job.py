"""engine.batch_invariant=true through the job: an OpenAI Batch file whose requests ask for
logprobs (greedy, and sampled with a seed) answers the same bytes however the job cuts and
batches its rows (flush_rows, window sizes, max_num_seqs, the step's token budget); on three Ray
replicas as on one local engine: tests/executor/test_ray_executor.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch

import batchpage.llm as llm_module
from batchpage.job import JobConfigError, run_job
from batchpage.ops import select
from batchpage.run import compose_job
from tests.job.test_loop import write_jsonl

COMPLETIONS = "/v1/completions"
WORDS = ["fox", "tree", "block", "cache", "world", "dog", "sum", "radix", "page"]


def requests(count: int) -> list[dict[str, Any]]:
    """Completions in shared-prefix groups, out of prefix order, asking for logprobs; every
    third sampled with a seed of its own."""
    lines = []
    for i in range(count):
        body: dict[str, Any] = {
            "model": "m",
            "prompt": f"The quick brown {WORDS[i % 9]} jumps over number {i} " * (1 + i % 3),
            "max_tokens": 8,
            "logprobs": 3,
            "temperature": 0.0,
        }
        if i % 3 == 2:
            body.update(temperature=0.9, top_p=0.9, seed=100 + i)
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": COMPLETIONS, "body": body})
    return lines


def args(data: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"dataset.path={data}",
        f"model.path={model}",
        "engine.dtype=float32",
        "engine.batch_invariant=true",
        "engine.kv_cache_memory=4194304",
        "engine.max_model_len=256",
        "sampling.ignore_eos=true",
        f"output_dir={out}",
        "progress=false",
        *extra,
    ]


def answers(out: Path) -> list[tuple[str, Any]]:
    """Each request's choices as written (text, logprobs, finish reason), in input order."""
    lines = [json.loads(x) for x in (out / "batch_output.jsonl").read_text().splitlines()]
    return [(x["custom_id"], x["response"]["body"]["choices"]) for x in lines]


def columns(out: Path) -> list[dict[str, Any]]:
    names = ["index", "completion", "logprobs", "finish_reason", "error"]
    return pq.read_table(out / "completions.parquet", columns=names).to_pylist()


CUTS = {  # how the job is cut and batched
    "one row at a time": ["flush_rows=1", "dataset.window_rows=1"],
    "wide windows": ["flush_rows=30", "dataset.window_rows=64", "engine.max_num_seqs=64"],
    "narrow steps": ["flush_rows=4", "engine.max_num_seqs=3", "engine.max_num_batched_tokens=24"],
}


def test_the_same_bytes_however_the_job_is_cut(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "batch.jsonl", requests(30))
    outs = {}
    for name, extra in CUTS.items():
        out = tmp_path / name.replace(" ", "_")
        run_job(compose_job(args(data, tiny_folder, out, *extra)))
        outs[name] = out
    first, *rest = outs.values()
    assert len(answers(first)) == 30
    assert all(c[0]["logprobs"]["top_logprobs"] for _, c in answers(first))
    for out in rest:
        assert answers(out) == answers(first)
        assert columns(out) == columns(first)


@pytest.mark.parametrize(
    ("extra", "backend", "dtype"),
    [
        (["engine.linear_backend=torch"], "torch", torch.float32),
        (["engine.linear_backend=onednn"], "onednn", torch.float32),
        (["engine.dtype=bfloat16"], "auto", torch.bfloat16),
    ],
)
def test_what_batch_invariant_cannot_run_is_refused_before_the_weights_load(
    tmp_path, tiny_folder, monkeypatch, extra: list[str], backend: str, dtype: torch.dtype
) -> None:
    """A forced backend whose rows depend on the batch, or bf16 on a CPU without AVX512-BF16
    (its kernel made unavailable here): the job stops with the words binding the linears would
    say (the reference), and no weight is read."""
    monkeypatch.setattr(select, "bf16_dot_kernel", lambda *a, **k: None)

    def no_weights(*a: Any, **k: Any) -> None:
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(llm_module, "load_model", no_weights)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError) as bound:
        select.select_linears(backend, dtype, cpu, batch_invariant=True)
    data = write_jsonl(tmp_path / "batch.jsonl", requests(2))
    cfg = compose_job(args(data, tiny_folder, tmp_path / "out", "engine.device=cpu", *extra))
    with pytest.raises(JobConfigError) as err:
        run_job(cfg)
    assert str(err.value) == str(bound.value)
    if backend == "torch":
        assert str(err.value).startswith("batch_invariant=True cannot run linear_backend='torch'")
