"""What a job prints when it ends describes that run: a rerun that resumes some rows counts the
tokens it generated itself (the reference: the completion_tokens of its rows in
completions.parquet), and one that resumes every row says it generated nothing and quotes no
earlier run's rate. run.json's totals still add up every run."""

from __future__ import annotations

import json

from batchpage.job import run_job
from batchpage.run import summary
from tests.job.test_loop import job, never, prompts, table, write_jsonl


def test_the_summary_says_what_this_run_did(tmp_path, tiny_folder) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(6))
    out = tmp_path / "out"
    run_job(job(data, tiny_folder, out, dataset={"limit": 2}))
    second = run_job(job(data, tiny_folder, out))
    rows = table(out)
    tokens = {r["index"]: r["completion_tokens"] for r in rows}
    lines = summary(second).splitlines()
    assert lines[0].startswith("6 rows (4 generated, 2 resumed, 0 with errors)"), lines
    this_run = sum(n for i, n in tokens.items() if i >= 2)
    assert lines[2].startswith(f"{this_run} tokens generated this run at "), lines
    report = json.loads((out / "run.json").read_text())
    assert report["metrics"]["generated_tokens"] == sum(tokens.values()) > this_run

    third = run_job(job(data, tiny_folder, out), never)  # every row done: no model loads
    said = summary(third)
    lines = said.splitlines()
    assert lines[0].startswith("6 rows (0 generated, 6 resumed, 0 with errors)"), said
    assert lines[2].startswith("no rows generated this run, wall time "), said
    assert "tok/s" not in said and "tokens generated" not in said
