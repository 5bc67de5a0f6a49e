"""score=humaneval: the code column of completions.parquet is checked in the sandbox, against
HumanEval's own canonical solutions as the reference of what passes."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.humaneval.checks import load_problems
from batchpage.job import run_job
from batchpage.job.humaneval_scores import SCORES_FILE, code_of, score_output
from batchpage.output import verify
from batchpage.run import compose_job, summary
from batchpage.storage import LocalStore


@pytest.fixture(scope="module")
def problems() -> dict:
    return load_problems()


def test_canonical_solutions_pass_and_wrong_ones_fail(tmp_path, problems) -> None:
    ids = ["HumanEval/0", "HumanEval/2", "HumanEval/4"]
    wrong = "    return None\n"
    codes = [problems["HumanEval/0"]["canonical_solution"], wrong, wrong]
    # An instruct reply: the whole function in a fence, extracted into the code column.
    reply = (
        "Here it is:\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\nIt keeps the fraction."
    )
    codes[1] = code_of("instruct", problems["HumanEval/2"]["prompt"], reply)
    table = pa.table({"id": ids, "completion": ["x"] * 3, "code": codes})
    pq.write_table(table, tmp_path / "completions.parquet")
    summary = score_output(tmp_path, "humaneval")
    assert (summary["samples"], summary["passed"], summary["problems"]) == (3, 2, 3)
    assert summary["pass_at_1"] == pytest.approx(2 / 3)
    scores = pq.read_table(tmp_path / SCORES_FILE).to_pylist()
    assert [s["passed"] for s in scores] == [True, True, False]
    assert scores[2]["status"] == "failed" and scores[2]["reason"]


def test_a_job_with_score_writes_code_and_scores(tmp_path, tiny_folder, monkeypatch) -> None:
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    cfg = compose_job(
        [
            "dataset.limit=2",
            "dataset.style=completion",  # the tiny model's tokenizer has a template too
            f"model.path={tiny_folder}",
            "sampling.max_tokens=3",
            "engine.max_model_len=2048",
            "score=humaneval",
            f"output_dir={tmp_path / 'out'}",
            "progress=false",
        ]
    )
    result = run_job(cfg)
    rows = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert [r["code"] for r in rows] == [r["completion"] for r in rows]  # completion style
    assert result.score is not None and result.score["samples"] == 2
    assert result.score["pass_at_1"] == 0.0  # a random tiny model solves nothing
    report = json.loads((tmp_path / "out" / "run.json").read_text())
    assert report["metrics"]["score"]["scorer"] == "humaneval"
    assert len(pq.read_table(tmp_path / "out" / SCORES_FILE)) == 2
    assert (result.score["checked"], result.score["reused"]) == (2, 0)
    # The commit point lists scores.parquet beside completions.parquet, as they are on disk.
    listed = {f["name"]: f for f in verify(LocalStore(), str(tmp_path / "out"))["files"]}
    assert sorted(listed) == ["completions.parquet", SCORES_FILE]
    assert listed[SCORES_FILE]["rows"] == 2

    # The rerun resumes both rows and keeps both verdicts: nothing runs in the sandbox again.
    again = run_job(cfg, lambda *a, **k: pytest.fail("the model must not load"))
    assert again.score is not None and (again.score["checked"], again.score["reused"]) == (0, 2)
    assert "(0 of 2 samples passed, 2 problems; 0 checked this run, 2 verdicts kept" in summary(
        again
    )


def test_an_unknown_scorer_is_refused_before_the_model_loads(tmp_path) -> None:
    from batchpage.job import JobConfigError

    cfg = compose_job(["score=bleu", f"output_dir={tmp_path}", "dataset=demo"])
    with pytest.raises(JobConfigError, match="score='bleu' is unknown"):
        run_job(cfg, lambda *a, **k: pytest.fail("the model must not load"))


@pytest.mark.parametrize(
    ("rows", "dataset", "message"),
    [
        (None, ["dataset=demo"], "row 0's id 'demo-0' is not a HumanEval task id"),
        (
            [{"id": "HumanEval/0", "prompt": "a"}, {"id": "q7", "prompt": "b"}],
            ["dataset.id_column=id"],
            "row 1's id 'q7' is not a HumanEval task id",
        ),
        ([{"prompt": "def f():"}], [], "no id column"),
    ],
)
def test_a_dataset_that_is_not_humaneval_is_refused_before_the_model_loads(
    tmp_path, rows, dataset: list[str], message: str
) -> None:
    from batchpage.job import JobConfigError

    if rows is not None:
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        dataset = [f"dataset.path={path}", *dataset]
    cfg = compose_job(["score=humaneval", f"output_dir={tmp_path / 'out'}", *dataset])
    with pytest.raises(JobConfigError, match=message) as err:
        run_job(cfg, lambda *a, **k: pytest.fail("the model must not load"))
    assert "dataset=evals" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_humaneval_ids_in_a_users_own_file_are_scorable(tmp_path, monkeypatch) -> None:
    from batchpage.job import plan_job

    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mine.jsonl"
    path.write_text(
        "".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": "x"}) + "\n" for i in range(3))
    )
    cfg = compose_job(["score=humaneval", f"dataset.path={path}", "dataset.id_column=task_id"])
    assert plan_job(cfg).info.id_column == "task_id"
    assert plan_job(compose_job(["score=humaneval", "dataset.limit=2"])).info.preset == "evals"


def test_a_rescoring_runs_only_new_or_changed_samples(tmp_path, problems, monkeypatch) -> None:
    """The second scoring of a grown completions.parquet runs in the sandbox only the rows added
    since and the row whose code changed; the others keep their verdicts, and the file equals a
    scoring from scratch. Counted at the sandbox's entry point."""
    from batchpage.humaneval import checks

    ran: list[str] = []
    real = checks.run_python

    def counting(program: str, limits=None):
        ran.append(program)
        return real(program, limits)

    monkeypatch.setattr(checks, "run_python", counting)
    right = {t: problems[t]["canonical_solution"] for t in problems}
    wrong = "    return None\n"

    def write(folder, rows: list[tuple[str, str | None]]) -> None:
        folder.mkdir(exist_ok=True)
        ids, codes = zip(*rows, strict=True)
        table = pa.table({"id": list(ids), "completion": ["x"] * len(ids), "code": list(codes)})
        pq.write_table(table, folder / "completions.parquet")

    first = [("HumanEval/0", right["HumanEval/0"]), ("HumanEval/2", wrong), ("HumanEval/4", None)]
    out = tmp_path / "out"
    write(out, first)
    summary = score_output(out, "humaneval")
    assert len(ran) == 2 and (summary["checked"], summary["reused"]) == (2, 0)

    # Two rows generated since, and HumanEval/2's code changed (now right).
    grown = [
        first[0],
        ("HumanEval/2", right["HumanEval/2"]),
        first[2],
        ("HumanEval/7", right["HumanEval/7"]),
        ("HumanEval/8", wrong),
    ]
    write(out, grown)
    ran.clear()
    again = score_output(out, "humaneval")
    assert len(ran) == 3 and (again["checked"], again["reused"]) == (3, 1)
    entry = problems["HumanEval/0"]["entry_point"]
    assert not any(f"check({entry})" in p for p in ran)  # the unchanged row did not run again

    write(tmp_path / "fresh", grown)
    ran.clear()
    fresh = score_output(tmp_path / "fresh", "humaneval")
    assert len(ran) == 4
    assert {k: again[k] for k in ("pass_at_1", "passed", "samples", "problems")} == {
        k: fresh[k] for k in ("pass_at_1", "passed", "samples", "problems")
    }
    kept = pq.read_table(out / SCORES_FILE).to_pylist()
    assert kept == pq.read_table(tmp_path / "fresh" / SCORES_FILE).to_pylist()
    assert [s["passed"] for s in kept] == [True, True, False, True, False]
