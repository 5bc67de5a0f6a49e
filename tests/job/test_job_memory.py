"""What a job holds does not grow with its rows: its Python heap at 20,000 rows against 2,000
(the engine answering at once, so that only the job's own bookkeeping is measured), and the
summary of completions.parquet read in batches against a reading of the whole file."""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage import LLM
from batchpage.data import DatasetSpec
from batchpage.engine.config import EngineConfig
from batchpage.job import report, run_job
from batchpage.job.config import JobConfig, ModelSpec, SamplingConfig
from batchpage.metrics import RunStats
from batchpage.request_outputs import CompletionOutput, RequestOutput
from batchpage.storage import Stores


def answering_at_once(llm: LLM) -> Any:
    """A factory of `llm` (loaded once, outside the measure) whose generate answers each prompt
    with one token without running the model, through the job's callbacks as the engine does,
    and counts in a RunStats of its own as the engine does."""

    def generate(prompts: list, params: Any, use_tqdm: bool = False, on_output: Any = None,
                 on_step: Any = None, **_: Any) -> list:  # fmt: skip
        stats = RunStats(llm.plan.num_blocks, 16)
        for i, ids in enumerate(prompts):
            stats.requests += 1
            stats.prompt_tokens += len(ids)
            stats.generated_tokens += 1
            stats.record_first_token()
            on_output(
                RequestOutput(str(i), None, ids, [CompletionOutput(0, " x", [7], "length")]), i
            )
            if on_step is not None and i % 64 == 0:
                on_step(stats)
        stats.finish()
        llm.run_stats = stats
        return []

    llm.generate = generate  # type: ignore[method-assign]
    return lambda *_, **__: llm


def heap_peak(tmp_path: Path, llm: LLM, model: Path, rows: int) -> int:
    """The job's Python heap at its peak, over what it held when it started (bytes)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / f"{rows}.jsonl"
    rng = random.Random(rows)
    words = ["summarize", "the", "quick", "brown", "fox", "explain", "why", "a", "poem"]
    with open(data, "w") as f:
        for i in range(rows):
            prompt = " ".join(rng.choices(words, k=rng.randint(4, 16)))
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt}) + "\n")
    cfg = JobConfig(
        model=ModelSpec(path=str(model)),
        dataset=DatasetSpec(path=str(data)),
        engine=EngineConfig(dtype="float32", kv_cache_memory=2**22, max_model_len=256),
        sampling=SamplingConfig(max_tokens=1, ignore_eos=True),
        output_dir=str(tmp_path / f"out{rows}"),
        progress=False,
    )
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        result = run_job(cfg, answering_at_once(llm))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.rows == rows and result.errors == 0
    return peak - start


@pytest.mark.slow
def test_a_jobs_heap_does_not_grow_with_its_rows(tmp_path: Path, tiny_folder: Path) -> None:
    """Ten times the rows, nearly the same peak: the done rows (a bitmap), the figures of every
    window (merged as each ends), the ids checked (packed), the final merge (a bucket of rows at
    a time) and the summary (a batch at a time) are what once grew with rows."""
    llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory=2**22, max_model_len=256)
    heap_peak(tmp_path / "warm", llm, tiny_folder, 300)  # imports and caches of a first job
    small = heap_peak(tmp_path, llm, tiny_folder, 2_000)
    large = heap_peak(tmp_path, llm, tiny_folder, 20_000)
    assert large < 1.5 * small, (small, large)


@pytest.mark.parametrize("seed", range(6))
def test_the_summary_read_in_batches_is_the_whole_files(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finish reasons (strings, or lists for n > 1), the first rows with a completion and the
    first error, read a few rows at a time, against the whole file read at once."""
    rng = random.Random(seed)
    listed = rng.random() < 0.5
    rows = []
    for i in range(rng.randint(0, 60)):
        failed = rng.random() < 0.2
        reasons = [rng.choice(["stop", "length", "", None]) for _ in range(2)]
        texts = [rng.choice(["", "a", "bc"]) for _ in range(rng.randint(0, 2))]
        rows.append({
            "id": f"r{i}",
            "completion": None if failed else (texts if listed else rng.choice(["", "x", None])),
            "finish_reason": None if failed else (reasons if listed else reasons[0]),
            "error": rng.choice(["bad row", "", "worse"]) if failed else None,
        })  # fmt: skip
    text = pa.list_(pa.string()) if listed else pa.string()
    schema = pa.schema([("id", pa.string()), ("completion", text), ("finish_reason", text),
                        ("error", pa.string())])  # fmt: skip
    path = tmp_path / "completions.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=7)
    store = Stores().store_for(str(path))

    expected_reasons: dict[str, int] = {}
    expected_samples, expected_error = [], ""
    for rec in rows:  # the whole file at once
        if rec["error"] is not None:
            expected_error = expected_error or rec["error"]
            continue
        found = rec["finish_reason"]
        for r in found if isinstance(found, list) else [found]:
            if r:
                expected_reasons[r] = expected_reasons.get(r, 0) + 1
        if len(expected_samples) < 2 and rec["completion"]:
            expected_samples.append({"id": rec["id"], "completion": rec["completion"]})

    monkeypatch.setattr(report, "SUMMARY_BATCH_ROWS", rng.choice([1, 3, 5]))
    reasons, samples, first_error = report.summarize(store, str(path))
    assert (reasons, samples, first_error) == (expected_reasons, expected_samples, expected_error)
