"""`python -m jobs.bench.short_rows` as a user runs it, on a few hundred rows: the engine's and
the job's rows of the table, every completion of the job equal to the engine's own on the same
prompt, the prompts of the asked lengths, and the overhead mode's row."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from tests.kernels.bench_smoke import markdown_tables, run_bench, table_with

ROWS = 240


def _rate(cell: str) -> float:
    """A rows/s cell ("**1,234** (0.91x)") as a number."""
    found = re.match(r"\**([\d,]+)", cell)
    assert found, cell
    return float(found.group(1).replace(",", ""))


@pytest.mark.slow  # two engines, a job subprocess and an in-process job on the tiny model
def test_engine_and_job_on_the_same_short_prompts(tmp_path) -> None:
    done = run_bench("jobs.bench.random_models", "tiny")
    assert done.returncode == 0, done.stderr
    tokenizer = AutoTokenizer.from_pretrained(done.stdout.strip())
    common = ["--rows", str(ROWS), "--tokens", "6,9", "--window", "64", "--threads", "1"]
    out = tmp_path / "short_rows.json"
    done = run_bench("jobs.bench.short_rows", *common, "--workdir", str(tmp_path), "--out",
                     str(out), timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = table_with(markdown_tables(done.stdout), "rows/s")
    whats = [r["what"] for r in rows]
    assert whats[:2] == [
        "engine `LLM.generate` (token ids, in calls of 64)",
        "engine `LLM.generate` (token ids, all at once)",
    ]
    assert [w.split(" (exit")[0] for w in whats[2:]] == [
        "job, command wall", "job, run.json wall_s", "job, run.json generate part",
    ]  # fmt: skip
    assert all(w.endswith("(exit 0)") for w in whats[2:])
    assert all(r["rows"] == f"{ROWS:,}" and _rate(r["rows/s"]) > 0 for r in rows)
    # The job's every completion is the engine's on the same prompt (its own greedy tokens).
    assert {r["same text"] for r in rows[2:]} == {f"{ROWS:,} / {ROWS:,}"}
    # The ratio printed is the job's rate over the engine's (all at once) rate.
    engine = _rate(rows[1]["rows/s"])
    for r in rows[2:]:
        ratio = float(re.search(r"\(([\d.]+)x\)", r["rows/s"]).group(1))
        assert ratio == pytest.approx(_rate(r["rows/s"]) / engine, abs=0.01)
    saved = json.loads(out.read_text())["results"]
    assert [r["what"] for r in saved] == ["engine", "engine", "job"]
    assert saved[2]["exit"] == 0 and saved[2]["run_json"]["rows_generated"] == ROWS
    assert saved[1]["rows_s"] == pytest.approx(engine, rel=0.01, abs=1)
    # Each prompt is as many tokens as words, within --tokens.
    with open(tmp_path / f"short-{ROWS}.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert lengths == [len(p.split()) for p in prompts]
    assert min(lengths) >= 6 and max(lengths) <= 9

    done = run_bench(
        "jobs.bench.short_rows", *common, "--workdir", str(tmp_path), "--what", "overhead"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = table_with(markdown_tables(done.stdout), "rows/s")
    assert row["what"] == "job on an instant engine (in process)" and row["rows"] == f"{ROWS:,}"
    assert _rate(row["rows/s"]) > 0 and "µs a row" in row["rows/s"]
