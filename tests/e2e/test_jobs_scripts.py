"""jobs/: the nightly HumanEval job (its score and history) and the synthetic-data job, and the
Hydra experiments they run."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.output import ShardWriter, finalize
from batchpage.run import compose_job
from jobs import nightly_eval as nightly
from jobs import synthetic_data as synthetic

ROOT = Path(__file__).resolve().parents[2]


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


def test_experiments_compose_and_the_users_overrides_win() -> None:
    cfg = compose_job(["+experiment=nightly_humaneval"])
    assert (cfg.dataset.path, cfg.sampling.temperature, cfg.sampling.max_tokens) == (
        "evals",
        0,
        384,
    )
    assert cfg.score == "humaneval" and cfg.dataset.style == "auto"
    folder = Path(cfg.output_dir)  # one folder a day, so that a same-day rerun resumes
    assert folder.parent == Path("nightly/runs")
    assert dt.datetime.strptime(folder.name, "%Y-%m-%d").date() >= dt.date.today() - dt.timedelta(1)
    cfg = compose_job(["+experiment=nightly_humaneval", "dataset=demo", "sampling.max_tokens=7"])
    assert (cfg.dataset.path, cfg.sampling.max_tokens) == ("demo", 7)
    cfg = compose_job(["+experiment=synthetic_data"])
    assert (cfg.dataset.path, cfg.dataset.limit, cfg.output_dir) == ("sharegpt", 1000, None)
    assert (cfg.sampling.n, cfg.sampling.temperature, cfg.sampling.top_p) == (4, 0.8, 0.95)
    assert (cfg.sampling.seed, cfg.sampling.max_tokens) == (0, 256)


def test_nightly_eval_scores_and_tracks_the_change(
    tiny_folder, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the job and the history go to nightly/ under the working folder
    args = ["dataset.limit=2", "sampling.max_tokens=4", *tiny(tiny_folder)]
    assert nightly.main(args) == 0
    assert "pass@1 0.0% on 2 problems" in capsys.readouterr().out
    assert nightly.main(args) == 0  # same day: resumes (nothing to generate) and rescores
    assert "+0.0 points since" in capsys.readouterr().out
    history = pq.read_table(tmp_path / "nightly" / "history.parquet").to_pylist()
    assert [h["problems"] for h in history] == [2, 2]
    assert history[0]["model"] == str(tiny_folder) and history[0]["generated_tokens"] == 8
    (run,) = (tmp_path / "nightly" / "runs").iterdir()
    scores = pq.read_table(run / "scores.parquet").to_pylist()
    assert [s["id"] for s in scores] == ["HumanEval/0", "HumanEval/1"]
    assert not any(s["passed"] for s in scores)  # a random tiny model solves nothing
    assert nightly.main([*args, "model.path=/no/such/model"]) == 2


def test_the_nightly_generation_runs_alone_as_a_hydra_experiment(
    tiny_folder, tmp_path, capsys
) -> None:
    """`python -m batchpage.run +experiment=nightly_humaneval` runs the nightly's own job: the
    script then finds the same job in the folder (another sampling would be refused, exit 2) and
    only scores it."""
    out = tmp_path / "runs" / "today"
    job = ["dataset.limit=2", "sampling.max_tokens=4", *tiny(tiny_folder), f"output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "batchpage.run", "+experiment=nightly_humaneval", *job]
    done = subprocess.run(
        [*cmd, f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["metrics"]["score"]["problems"] == 2
    # The tiny model's tokenizer has a chat template: HumanEval is posed in the instruct form.
    assert run["config"]["resolved"]["style"] == "instruct"
    assert nightly.main([*job, f"--history={tmp_path / 'history.parquet'}"]) == 0
    assert "pass@1 0.0% on 2 problems" in capsys.readouterr().out
    assert json.loads((out / "run.json").read_text())["metrics"] == run["metrics"]


@pytest.mark.slow
def test_nightly_eval_runs_lm_eval_tasks_through_the_backend(tiny_folder, tmp_path, capsys) -> None:
    from tests.test_lm_eval import write_tasks

    tasks = write_tasks(tmp_path)
    out = tmp_path / "run"
    args = [
        "dataset.limit=1",
        "sampling.max_tokens=2",
        *tiny(tiny_folder),
        f"output_dir={out}",
        f"--history={tmp_path / 'history.parquet'}",
        "--lm-eval-tasks=tiny_mc,tiny_ppl",
        f"--lm-eval-include-path={tasks}",
        "--lm-eval-limit=2",
    ]
    assert nightly.main(args) == 0
    results = json.loads((out / "lm_eval.json").read_text())
    assert set(results) == {"tiny_mc", "tiny_ppl"}
    (row,) = pq.read_table(tmp_path / "history.parquet").to_pylist()
    headline = json.loads(row["lm_eval"])
    assert 0.0 <= headline["tiny_mc"]["acc,none"] <= 1.0
    assert headline["tiny_ppl"]["word_perplexity,none"] > 1.0
    assert "lm-eval:" in capsys.readouterr().out


def test_the_report_names_what_changed() -> None:
    now = {"pass_at_1": 0.5, "problems": 3, "model": "m", "passed_tasks": ["a", "b"]}
    before = {**now, "pass_at_1": 0.25, "passed_tasks": ["c"], "timestamp": "yesterday"}
    text = nightly.report(now, before)
    assert "+25.0 points since yesterday" in text
    assert "newly passing: a, b" in text and "newly failing: c" in text


def test_dedup_normalises_whitespace_and_drops_empty_and_failed(tmp_path) -> None:
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


def test_synthetic_data_samples_n_per_seed(tiny_folder, tmp_path, capsys) -> None:
    seeds = tmp_path / "seeds.parquet"
    pq.write_table(pa.table({"prompt": ["Hello world", "The quick brown fox", "Paged"]}), seeds)
    out = tmp_path / "synthetic.parquet"
    args = ["sampling.n=3", "sampling.max_tokens=3", f"--out={out}", f"dataset.path={seeds}"]
    assert synthetic.main([*args, "dataset.limit=null", *tiny(tiny_folder)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert 0 < len(rows) <= 9 and set(rows[0]) == {"seed_id", "prompt", "completion"}
    assert {r["prompt"] for r in rows} <= {"Hello world", "The quick brown fox", "Paged"}
    assert len({" ".join(r["completion"].split()) for r in rows}) == len(rows)
    assert "unique completions from 3 seeds" in capsys.readouterr().out
    job = pq.read_table(tmp_path / "synthetic.parquet.job" / "completions.parquet")
    assert job.schema.field("completion").type == pa.list_(pa.string())
