"""jobs/: the nightly HumanEval job (its score and history) and the synthetic-data job, and the
Hydra experiments they run. The scripts run as a user runs them, `python -m jobs.<name>`, and the
tests read what they print and write (tests do not import jobs/)."""

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

from batchpage.run import compose_job
from tests.kernels.bench_smoke import ROOT, run_bench


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


def nightly(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return run_bench("jobs.nightly_eval", *args, cwd=cwd)


def test_nightly_eval_scores_and_tracks_the_change(tiny_folder, tmp_path) -> None:
    """The job and the history go to nightly/ under the working folder; a same-day rerun resumes
    (nothing to generate) and rescores; the report names the change and the problems that
    flipped since the last comparable run."""
    args = ["dataset.limit=2", "sampling.max_tokens=4", *tiny(tiny_folder)]
    first = nightly(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "pass@1 0.0% on 2 problems" in first.stdout
    assert "the first run in the history" in first.stdout
    history_file = tmp_path / "nightly" / "history.parquet"
    history = pq.read_table(history_file).to_pylist()
    assert history[0]["model"] == str(tiny_folder) and history[0]["generated_tokens"] == 8
    # As if yesterday's run had solved HumanEval/1: today's report says it now fails.
    yesterday = {**history[0], "timestamp": "yesterday", "pass_at_1": 0.5,
                 "passed_tasks": ["HumanEval/1"]}  # fmt: skip
    pq.write_table(pa.Table.from_pylist([yesterday]), history_file)
    second = nightly(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "-50.0 points since yesterday" in second.stdout
    assert "newly failing: HumanEval/1" in second.stdout and "newly passing" not in second.stdout
    assert [h["problems"] for h in pq.read_table(history_file).to_pylist()] == [2, 2]
    (run,) = (tmp_path / "nightly" / "runs").iterdir()
    scores = pq.read_table(run / "scores.parquet").to_pylist()
    assert [s["id"] for s in scores] == ["HumanEval/0", "HumanEval/1"]
    assert not any(s["passed"] for s in scores)  # a random tiny model solves nothing
    assert nightly(*args, "model.path=/no/such/model", cwd=tmp_path).returncode == 2


def test_the_nightly_generation_runs_alone_as_a_hydra_experiment(tiny_folder, tmp_path) -> None:
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
    scored = nightly(*job, f"--history={tmp_path / 'history.parquet'}")
    assert scored.returncode == 0, scored.stderr
    assert "pass@1 0.0% on 2 problems" in scored.stdout
    assert json.loads((out / "run.json").read_text())["metrics"] == run["metrics"]


@pytest.mark.slow
def test_nightly_eval_runs_lm_eval_tasks_through_the_backend(tiny_folder, tmp_path) -> None:
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
    done = nightly(*args)
    assert done.returncode == 0, done.stderr
    results = json.loads((out / "lm_eval.json").read_text())
    assert set(results) == {"tiny_mc", "tiny_ppl"}
    (row,) = pq.read_table(tmp_path / "history.parquet").to_pylist()
    headline = json.loads(row["lm_eval"])
    assert 0.0 <= headline["tiny_mc"]["acc,none"] <= 1.0
    assert headline["tiny_ppl"]["word_perplexity,none"] > 1.0
    assert "lm-eval:" in done.stdout


def test_synthetic_data_keeps_each_completion_once(tiny_folder, tmp_path) -> None:
    """Greedy, two samples of two equal seeds give one completion four times: it is kept once;
    a seed that is not text is that row's error and counted as a failed seed."""
    seeds = tmp_path / "seeds.parquet"
    pq.write_table(pa.table({"prompt": ["Hello world", "Hello world", None]}), seeds)
    out = tmp_path / "synthetic.parquet"
    done = run_bench(
        "jobs.synthetic_data", "sampling.n=2", "sampling.temperature=0", "sampling.max_tokens=3",
        f"--out={out}", f"dataset.path={seeds}", "dataset.limit=null", *tiny(tiny_folder),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = f"1 unique completions from 3 seeds -> {out} (3 duplicates, 0 empty, 1 failed seeds"
    assert said in done.stdout
    (row,) = pq.read_table(out).to_pylist()
    assert (row["seed_id"], row["prompt"]) == ("0", "Hello world")
    # Cut at max_tokens=3 (the tiny model does not stop so soon), and marked so.
    job = pq.read_table(tmp_path / "synthetic.parquet.job" / "completions.parquet").to_pylist()
    assert row["finish_reason"] == job[0]["finish_reason"][0] == "length"
    assert "1 kept cut at max_tokens: finish_reason length" in done.stdout


def test_synthetic_data_samples_n_per_seed(tiny_folder, tmp_path) -> None:
    seeds = tmp_path / "seeds.parquet"
    pq.write_table(pa.table({"prompt": ["Hello world", "The quick brown fox", "Paged"]}), seeds)
    out = tmp_path / "synthetic.parquet"
    args = ["sampling.n=3", "sampling.max_tokens=3", f"--out={out}", f"dataset.path={seeds}"]
    done = run_bench("jobs.synthetic_data", *args, "dataset.limit=null", *tiny(tiny_folder))
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(out).to_pylist()
    assert 0 < len(rows) <= 9
    assert set(rows[0]) == {"seed_id", "prompt", "completion", "finish_reason"}
    assert {r["prompt"] for r in rows} <= {"Hello world", "The quick brown fox", "Paged"}
    assert len({" ".join(r["completion"].split()) for r in rows}) == len(rows)
    assert "unique completions from 3 seeds" in done.stdout
    job = pq.read_table(tmp_path / "synthetic.parquet.job" / "completions.parquet")
    assert job.schema.field("completion").type == pa.list_(pa.string())
