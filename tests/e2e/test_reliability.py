"""jobs/bench/reliability.py's core on the tiny model: one kill trial resumes to the clean run's
rows, the comparison sees a lost, duplicated or changed row, and every bad input gets its exit
code and message."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.bench.bad_inputs import run_cases
from jobs.bench.kill_trials import FINAL, Comparison, compare, run_trials
from tests.job.test_run_cli import write_prompts


def tiny_job(tmp_path: Path, model: Path, rows: int = 6) -> list[str]:
    return [
        f"dataset.path={write_prompts(tmp_path / 'd.jsonl', rows)}",
        f"model.path={model}",
        "engine.dtype=float32",
        "engine.kv_cache_memory=4194304",
        "engine.max_model_len=128",  # the hostile GGUFs' limit: they are refused for themselves
        "dataset.window_rows=2",
        "flush_rows=1",
        "sampling.max_tokens=8",
        "sampling.ignore_eos=true",
        "progress=false",
    ]


@pytest.mark.slow  # three runs of the job: about 50 s each on 2 busy cores
def test_one_kill_trial_resumes_to_the_clean_rows(tmp_path, tiny_folder) -> None:
    timeline, trials = run_trials(tiny_job(tmp_path, tiny_folder), 1, tmp_path, seed=0)
    assert 0 < timeline.first_shard <= timeline.final <= timeline.end
    (trial,) = trials
    assert trial.aimed_at == "load" and trial.rerun_exit == 0
    assert trial.result == Comparison(rows=6, lost=0, duplicated=0, different=0)


def test_the_comparison_sees_lost_duplicated_and_changed_rows(tmp_path) -> None:
    clean = tmp_path / "clean"
    clean.mkdir()
    rows = [
        {"id": str(i), "index": i, "prompt": "p", "completion": f"c{i}", "finish_reason": "length",
         "prompt_tokens": 3, "error": None}
        for i in range(5)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), clean / FINAL)
    assert compare(clean, clean) == Comparison(5, 0, 0, 0)
    bad = tmp_path / "bad"
    bad.mkdir()
    changed = {**rows[2], "completion": "other"}
    pq.write_table(pa.Table.from_pylist([rows[0], rows[0], changed, rows[3]]), bad / FINAL)
    assert compare(clean, bad) == Comparison(rows=4, lost=2, duplicated=1, different=1)
    shutil.rmtree(bad)
    bad.mkdir()
    assert compare(clean, bad) == Comparison(0, 5, 0, 0)  # no output at all


@pytest.mark.slow
def test_every_bad_input_gets_its_exit_code_and_message(tmp_path, tiny_folder) -> None:
    job = tiny_job(tmp_path, tiny_folder, rows=3)
    run_trials(job, 0, tmp_path, seed=0)  # the clean run the damaged-shard case starts from
    found = {o.case: o for o in run_cases(job, tmp_path / "clean", tmp_path)}
    expected = {
        "invalid UTF-8 in one JSONL line": (0, "utf8.jsonl line 2 is not valid UTF-8"),
        "duplicate ids (dataset.id_column=id)": (2, "duplicate"),
        "output_dir is a file": (2, "taken"),
        "unknown Hydra key (sampling.temprature)": (2, "Key 'temprature' not in"),
        "wrong type (engine.block_size=big)": (2, "could not be converted to Integer"),
        "GGUF cut inside its header": (2, "corrupt or truncated GGUF header"),
        "GGUF with a 4e9 vocab_size": (2, "llama.vocab_size is 4000000000"),
        "GGUF with head_count 0": (2, "llama.attention.head_count is 0"),
        "GGUF with block_count 2^31-1": (2, "2147483647 layers"),
        "damaged shard (garbage bytes), rerun": (0, "unreadable shard"),
    }
    assert set(found) == set(expected)
    for case, (code, text) in expected.items():
        assert found[case].exit_code == code and text in found[case].message, found[case]
    damaged = found["damaged shard (garbage bytes), rerun"]
    assert damaged.rows_as_clean == "3 rows, 0 lost, 0 dup., 0 differ"
