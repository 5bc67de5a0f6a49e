"""`python -m jobs.bench.ab` on the tiny random-weight model (jobs/bench/random_models.py), run as
a user runs it: two configurations in one process, a revision in a git worktree against this
tree, and a bad option refused before any engine loads (tests do not import jobs/)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.kernels.bench_smoke import ROOT, markdown_tables, run_bench, table_with

SMOKE = ["--smoke", "--workloads", "random,fewshot", "--decode-prompts", "random"]


@pytest.fixture(scope="module")
def tiny() -> str:
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def ab(tiny: str, out: Path, *args: str) -> dict:
    done = run_bench("jobs.bench.ab", "--model", tiny, *SMOKE, "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    table = table_with(markdown_tables(done.stdout), "A vs B")
    assert [(r["workload"], r["side"]) for r in table] == [
        (w, s) for w in ("random", "fewshot") for s in ("A", "B")
    ]
    return data


def test_two_configurations_take_turns_on_the_same_work(tiny, tmp_path) -> None:
    """The same configuration on both sides: every request gets the same greedy tokens, and
    every run of a workload computes the same prefill on either side (each run's prompts start
    with a token of their own, so no run finds what an earlier one cached), though fewshot's
    requests share their 1-shot prompt within a run."""
    data = ab(tiny, tmp_path / "ab.json", "--a", "attention_backend=cpu", "--b",
              "attention_backend=cpu", "--decode-steps", "4")  # fmt: skip
    assert data["sides"]["A"]["options"] == {"attention_backend": "cpu"}
    for r, w in zip(data["results"], data["workloads"], strict=True):
        assert r["same_greedy"] == r["requests"] == w["requests"] == 4
        runs = [s for side in ("A", "B") for s in r[side]["stats"]]
        assert len(runs) == 4 and all(len(r[side]["runs_tok_s"]) == 2 for side in ("A", "B"))
        computed = {s["prefill_tokens_computed"] for s in runs}
        assert computed == {runs[0]["prefill_tokens_computed"]}
        salted = w["prompt_tokens"] + w["requests"]
        if w["name"] == "fewshot":
            assert runs[0]["prefix_hit_rate"] > 0 and runs[0]["prefill_tokens_computed"] < salted
        else:
            assert runs[0]["prefill_tokens_computed"] == salted
        assert r["A"]["tok_s"] > 0 and r["B"]["tok_s"] > 0
    decode = data["decode"]
    assert decode["running"] == 4 and all(len(decode[s]["runs_ms"]) == 2 for s in ("A", "B"))
    assert decode["A"]["ms"] > 0 and decode["B"]["ms"] > 0


@pytest.mark.slow  # a worktree of HEAD and two worker processes
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="git")
def test_a_revision_runs_from_its_own_worktree(tiny, tmp_path) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip()

    head = git("rev-parse", "HEAD")  # named by its sha: another commit may land meanwhile
    data = ab(tiny, tmp_path / "ab.json", "--b-rev", head, "--a", "attention_backend=torch")
    sides = data["sides"]
    assert sides["B"]["where"] == f"{head} ({head[:12]})"
    assert sides["A"]["where"] == "this working tree"
    assert not Path(sides["B"]["batchpage"]).is_relative_to(ROOT)  # the worktree's
    assert Path(sides["A"]["batchpage"]) == ROOT / "batchpage" / "__init__.py"
    assert "batchpage-ab-" not in git("worktree", "list")  # removed at the end


def test_a_bad_option_fails_before_any_engine_loads(tiny) -> None:
    done = run_bench("jobs.bench.ab", "--model", tiny, *SMOKE, "--a", "attention_backend=gpu")
    assert done.returncode != 0
    assert "side A: attention_backend must be one of" in done.stderr
    assert "engine loaded" not in done.stderr
    done = run_bench("jobs.bench.ab", "--model", tiny, *SMOKE, "--b", "no_such_option")
    assert done.returncode != 0 and "--b: 'no_such_option' is not KEY=VALUE" in done.stderr
