"""`python -m jobs.bench.reliability` on the tiny model, run as a user runs it: one kill trial
resumes to the clean run's rows, every bad input gets its exit code and message, and mutated GGUF
files load or are refused without a crash. The tests read the tables it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.job.test_run_cli import write_prompts
from tests.kernels.bench_smoke import markdown_tables, run_bench, table_with

ROWS = 6
FUZZ = 20


@pytest.mark.slow  # a clean run, a killed run and its rerun, ten bad inputs: minutes on 2 cores
def test_the_reliability_benchmark_on_the_tiny_model(tmp_path: Path, tiny_folder: Path) -> None:
    data = write_prompts(tmp_path / "d.jsonl", ROWS)
    done = run_bench(
        "jobs.bench.reliability", "--trials", "1", "--rows", str(ROWS), "--max-tokens", "8",
        "--fuzz", str(FUZZ), "--model", str(tiny_folder), "--workdir", str(tmp_path / "work"),
        f"dataset.path={data}", "engine.dtype=float32", "engine.kv_cache_memory=4194304",
        "engine.max_model_len=128",  # the hostile GGUFs' limit: they are refused for themselves
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    timeline = re.search(
        r"clean run: first shard at ([\d.]+) s, completions.parquet at ([\d.]+) s, exit at "
        r"([\d.]+) s",
        done.stdout,
    )
    assert timeline is not None, done.stdout
    first_shard, final, end = map(float, timeline.groups())
    assert 0 < first_shard <= final <= end
    found = markdown_tables(done.stdout)

    trial, total = table_with(found, "aimed at")
    assert (trial["trial"], trial["aimed at"], trial["rerun exit"]) == ("1", "load", "0")
    counts = [trial[k] for k in ("rows", "lost", "duplicated", "different")]
    assert counts == [str(ROWS), "0", "0", "0"]
    assert total["trial"] == "all" and total["rerun exit"] == "0 failed"

    expected = {
        "invalid UTF-8 in one JSONL line": ("0", "utf8.jsonl line 2 is not valid UTF-8"),
        "duplicate ids (dataset.id_column=id)": ("2", "duplicate"),
        "output_dir is a file": ("2", "taken"),
        "unknown Hydra key (sampling.temprature)": ("2", "Key 'temprature' not in"),
        "wrong type (engine.block_size=big)": ("2", "could not be converted to Integer"),
        "GGUF cut inside its header": ("2", "corrupt or truncated GGUF header"),
        "GGUF with a 4e9 vocab_size": ("2", "llama.vocab_size is 4000000000"),
        "GGUF with head_count 0": ("2", "llama.attention.head_count is 0"),
        "GGUF with block_count 2^31-1": ("2", "2147483647 layers"),
        "damaged shard (garbage bytes), rerun": ("0", "unreadable shard"),
        "a comma in dataset.path, unquoted": ("2", """quote it: 'dataset.path="a,b.jsonl"'"""),
        "sampling.structured_outputs.json nested 1,000 levels": ("2", "over the limit of 64"),
        "a row's response_format nested 1,000 levels": ("0", "deeprow.jsonl line 2 nests"),
        "a Parquet file with two prompt columns": ("2", "more than one column named 'prompt'"),
        "a CSV record 5x dataset.max_prompt_bytes": ("2", "the first starts on line 3"),
        # #52's classes: a pooling job's bad row ends the job well; job-wide settings fail before
        # loading; a late JSONL column is carried.
        "an embed job with one empty prompt": ("0", "prompt is empty"),
        "sampling.thinking_token_budget, no reasoning parser": ("2", "reasoning_parser"),
        "sampling.stop_token_ids outside the vocabulary": ("2", "sampling.stop_token_ids"),
        "a job-wide regex that does not compile": ("2", "structured_outputs.regex is invalid"),
        "a chat template that raises on a one-line chat": ("2", "one system turn first"),
        "flush_rows=0": ("2", "flush_rows=0 must be >= 1"),
        "flush_seconds=-1": ("2", "flush_seconds=-1.0 must be"),
        "output_dir is the dataset's folder": ("2", "overlaps the input folder"),
        "engine.tensor_parallel_size=64 on this CPU": ("2", "tensor_parallel_size=64"),
        "a JSONL column first seen on line 1,200": ("0", "column 'late' carried"),
        # #69: a bad line with ids is its row's error; `+` keys are checked; a dry run writes
        # nothing (so overlaps nothing); batch_invariant's refusals come before loading.
        "invalid UTF-8 in one JSONL line, with an id column": (
            "0",
            "utf8_ids.jsonl line 2 is not valid UTF-8",
        ),
        "a misspelled key added with + (+sampling.max_tokenz=3)": (
            "2",
            "Key 'max_tokenz' not in 'SamplingConfig'",
        ),
        "dry_run=true, no output_dir, run from the input's folder": ("0", ""),
        "engine.batch_invariant=true, engine.linear_backend=torch": (
            "2",
            "cannot run linear_backend='torch'",
        ),
        # #69: bad LoRA adapters in model.loras (given as one dict) stop the job before loading.
        "model.loras={a: ..., b: ...}, b's weights NaN": ("2", "holds NaN values"),
        "model.loras={a: ..., b: ...}, b's weights infinite": ("2", "holds infinite values"),
        "a LoRA adapter_config.json with r=8, tensors of rank 4": ("2", "module rank 8"),
        "a LoRA adapter_config.json targeting modules the model lacks": (
            "2",
            "select none of the modules",
        ),
    }
    bad = {row["input"]: row for row in table_with(found, "first line of the message")}
    assert set(expected) <= set(bad)
    # Every other case (#32's classes) ends as a job should: done, or one line and exit 2.
    assert all(row["exit"] in ("0", "2") for row in bad.values()), bad
    for case, (code, text) in expected.items():
        row = bad[case]
        assert row["exit"] == code and text in row["first line of the message"], row
    damaged = bad["damaged shard (garbage bytes), rerun"]
    assert damaged["rows"] == f"{ROWS} rows, 0 lost, 0 dup., 0 differ"

    outcomes = {row["outcome"]: int(row["files"]) for row in table_with(found, "outcome")}
    assert sum(outcomes.values()) == FUZZ
    assert set(outcomes) <= {"loaded", "CorruptGGUFError", "UnsupportedModelError", "ValueError"}
