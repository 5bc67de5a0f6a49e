"""One input cannot take the job's memory or time: a hostile chat template in the model folder
(exit 2 before the model loads when it fails even a one-line chat, that row's error when only
some data sets it off), a 10 MB JSONL line and a prompt over dataset.max_prompt_bytes (that
row's error, never tokenized, the line never held whole), and a path that is not a regular
file (exit 2 at once)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.data import DatasetError, DatasetSpec, iter_rows, validate
from batchpage.data.readers import DEFAULT_MAX_PROMPT_BYTES
from batchpage.job import JobConfigError, run_job
from batchpage.job.config import SamplingConfig, StructuredOutputsConfig
from batchpage.json_depth import MAX_SCHEMA_DEPTH
from batchpage.model.tokenizer import Tokenizer
from tests.job.test_loop import job, never, table, write_jsonl
from tests.job.test_run_cli import cli, tiny_job_args

EXPLODES = "{% set ns = namespace(s='x') %}{% for i in range(99) %}{% set ns.s = ns.s ~ ns.s %}"
EXPLODES += "{% endfor %}{{ ns.s }}"
# Only a chat that says "boom" sets it off: the template is fine for every other row.
ON_BOOM = (
    "{% for m in messages %}{% if 'boom' in m.content %}{{ 'x' * 3000000000 }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
CHAT_DATASET = {"messages_column": "messages", "prompt_column": None}


def folder_with_template(tiny_folder: Path, where: Path, template: str) -> Path:
    model = shutil.copytree(tiny_folder, where)
    (model / "chat_template.jinja").write_text(template)
    return model


def chats(*texts: str) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": t}]} for t in texts]


def test_a_template_that_fails_any_chat_exits_2_before_the_model_loads(
    tmp_path: Path, tiny_folder: Path
) -> None:
    model = folder_with_template(tiny_folder, tmp_path / "model", EXPLODES)
    data = write_jsonl(tmp_path / "d.jsonl", chats("hi", "there"))
    cfg = job(data, model, tmp_path / "out", dataset=CHAT_DATASET)
    with pytest.raises(JobConfigError, match=r"the model's chat template fails on a one-line"):
        run_job(cfg, llm_factory=never)
    args = [*tiny_job_args(data, model, tmp_path / "cli"), "dataset.messages_column=messages"]
    proc = cli([*args, "dataset.prompt_column=null"], tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "'~' would make a value of" in err


def test_a_template_set_off_by_one_row_is_that_rows_error(tmp_path: Path, tiny_folder) -> None:
    model = folder_with_template(tiny_folder, tmp_path / "model", ON_BOOM)
    data = write_jsonl(tmp_path / "d.jsonl", chats("hello", "boom now", "world"))
    result = run_job(job(data, model, tmp_path / "out", dataset=CHAT_DATASET))
    assert (result.rows, result.errors) == (3, 1)
    got = table(tmp_path / "out")
    assert got[1]["error"].startswith("chat template failed: the chat template's '*' would")
    assert got[0]["completion"] and got[2]["completion"]


def test_a_10mb_jsonl_line_is_its_rows_error_without_being_held(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        f.write('{"prompt": "first"}\n')
        line = json.dumps({"prompt": "y" * 10_000_000})
        f.write(line + "\n")
        f.write('{"prompt": "last"}\n')
    tracemalloc.start()
    started = time.perf_counter()
    rows = list(iter_rows(DatasetSpec(path=str(data))))
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [r.prompt for r in rows] == ["first", None, "last"]
    assert rows[1].error == (
        f"d.jsonl line 2 is {len(line):,} bytes, over dataset.max_prompt_bytes="
        f"{DEFAULT_MAX_PROMPT_BYTES}: shorten that row, or raise the bound"
    )
    # validate and the row pass each read the file; no pass held the 10 MB line whole.
    assert peak < 10_000_000
    assert elapsed < 5.0  # measured: well under a second (the line is skipped, not parsed)


def test_a_prompt_over_the_bound_never_reaches_the_tokenizer(
    tmp_path: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[int] = []
    encode, encode_batch = Tokenizer.encode, Tokenizer.encode_batch

    def spy(self: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(len(text))
        return encode(self, text, add_special_tokens)

    def batch_spy(self: Tokenizer, texts: list[str], add_special_tokens: bool = True) -> list:
        encoded.extend(len(t) for t in texts)
        return encode_batch(self, texts, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", spy)
    monkeypatch.setattr(Tokenizer, "encode_batch", batch_spy)
    data = tmp_path / "d.parquet"
    big = "z" * (DEFAULT_MAX_PROMPT_BYTES + 1)
    pq.write_table(pa.table({"prompt": ["short one", big, "é" * 3000]}), data)
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"max_prompt_bytes": 5000})
    run_job(cfg)
    got = table(tmp_path / "out")
    assert got[1]["error"] == (
        f"the prompt is {len(big):,} bytes, over dataset.max_prompt_bytes=5000: shorten it, "
        "or raise the bound"
    )
    assert got[2]["error"].startswith("the prompt is 6,000 bytes")  # UTF-8 bytes, not chars
    assert got[0]["completion"] and max(encoded) < 5000

    # The chat template's text is bounded the same way (a short chat, a long rendering).
    echo = "{% for i in range(50) %}{{ messages[0].content }}{% endfor %}"
    model = folder_with_template(tiny_folder, tmp_path / "model", echo)
    data = write_jsonl(tmp_path / "c.jsonl", chats("a" * 99, "b"))
    dataset = {**CHAT_DATASET, "max_prompt_bytes": 1000}
    run_job(job(data, model, tmp_path / "chat", dataset=dataset))
    got = table(tmp_path / "chat")
    assert got[0]["error"].startswith("chat template failed: the chat template's text for one")
    assert got[1]["error"] is None and max(encoded) < 5000


def test_a_csv_record_over_the_bound_fails_the_file_naming_its_line(
    tmp_path: Path, tiny_folder: Path
) -> None:
    """Arrow's CSV reader cannot skip a record longer than its block: the file's error names
    the first such record's line and the bound that reads them all, and nothing runs."""
    data = tmp_path / "d.csv"
    quoted = (
        '"a ""quoted"" field\nover two lines ' + "q" * 3000 + '"'
    )  # line 3, 3,038 bytes with ,2
    data.write_text(f"prompt,n\nshort,1\n{quoted},2\nshort again,3\n{'w' * 9000},4\nlast,5\n")
    refused = (
        f"{data} has CSV records over dataset.max_prompt_bytes=1000 bytes, which the CSV reader "
        "cannot skip (the first starts on line 3, 3,038 bytes; the longest is 9,002): shorten "
        "them, set dataset.max_prompt_bytes=9002 or more, or give the data as JSONL or Parquet, "
        "where such a row is its own error"
    )
    with pytest.raises(JobConfigError) as err:
        run_job(job(data, tiny_folder, tmp_path / "out", dataset={"max_prompt_bytes": 1000}), never)
    assert str(err.value) == refused and not (tmp_path / "out").exists()
    # The bound it names reads every record, each whole.
    got = list(iter_rows(DatasetSpec(path=str(data), max_prompt_bytes=9002)))
    assert [(r.prompt, r.error) for r in got] == [
        ("short", None),
        ('a "quoted" field\nover two lines ' + "q" * 3000, None),
        ("short again", None),
        ("w" * 9000, None),
        ("last", None),
    ]


def test_a_resume_under_another_prompt_bound_is_refused_naming_it(tmp_path, tiny_folder) -> None:
    """The bound decides which rows are errors: rows written under one bound are not mixed with
    rows of another (overwrite=true starts over)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": "long " * 30}])
    out = tmp_path / "out"
    run_job(job(data, tiny_folder, out, dataset={"max_prompt_bytes": 100}))
    assert table(out)[1]["error"].startswith("d.jsonl line 2 is 164 bytes, over")
    with pytest.raises(JobConfigError, match=r"changed: dataset.max_prompt_bytes: 100 -> 1000"):
        run_job(job(data, tiny_folder, out, dataset={"max_prompt_bytes": 1000}), never)
    run_job(job(data, tiny_folder, out, dataset={"max_prompt_bytes": 1000}, overwrite=True))
    assert [r["error"] for r in table(out)] == [None, None]


def test_a_path_that_is_not_a_regular_file_is_refused(tmp_path: Path, tiny_folder) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    for path in (fifo, link, Path("/dev/zero")):
        with pytest.raises(DatasetError, match="is not a regular file"):
            validate(DatasetSpec(path=str(path)))
    with pytest.raises(DatasetError, match="max_prompt_bytes=0 must be >= 1"):
        validate(DatasetSpec(path=str(tiny_folder), max_prompt_bytes=0))
    proc = cli(
        tiny_job_args(Path("/dev/zero"), tiny_folder, tmp_path / "o"),
        tmp_path,
        stderr=subprocess.PIPE,
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip() == (
        "error: dataset.path='/dev/zero' is not a regular file (a device, FIFO or socket); "
        "point it at a data file, a folder or a glob"
    )


def nested_schema(levels: int) -> str:
    """A JSON schema of arrays in arrays, `levels` objects deep."""
    return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)


def test_a_schema_nested_1000_levels_is_refused_before_the_model_loads(
    tmp_path: Path, tiny_folder: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    deep = StructuredOutputsConfig(json=nested_schema(1000))
    cfg = job(data, tiny_folder, tmp_path / "out", sampling={"structured_outputs": deep})
    refused = (
        f"sampling.structured_outputs.json nests objects and arrays 1000 levels deep, over the "
        f"limit of {MAX_SCHEMA_DEPTH}: flatten the schema"
    )
    with pytest.raises(JobConfigError) as err:
        run_job(cfg, llm_factory=never)
    assert str(err.value) == refused
    schema = f"sampling.structured_outputs.json='{nested_schema(1000)}'"
    proc = cli([*tiny_job_args(data, tiny_folder, tmp_path / "cli"), schema], tmp_path,
               stderr=subprocess.PIPE)  # fmt: skip
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and stderr == f"error: {refused}\n"
    # Brackets inside strings (escaped quotes too) are text, not nesting.
    text = json.dumps({"type": "string", "description": '\\"' + "[{" * 100})
    sampling = SamplingConfig(structured_outputs=StructuredOutputsConfig(json=text))
    assert sampling.to_params().structured_outputs.json == json.loads(text)


def test_a_rows_schema_nested_too_deep_is_that_rows_error(tmp_path: Path, tiny_folder) -> None:
    def response_format(schema: str) -> str:
        return '{"type": "json_schema", "json_schema": {"schema": ' + schema + "}}"

    brackets = json.dumps({"type": "string", "description": '\\"' + "[{" * 100})
    lines = [
        '{"prompt": "first"}',
        # Past json.loads' recursion, as a value of the line and as JSON text in it.
        '{"prompt": "a", "response_format": ' + response_format(nested_schema(1000)) + "}",
        json.dumps({"prompt": "b", "response_format": response_format(nested_schema(1000))}),
        # Read, but over the bound: refused before xgrammar compiles it.
        '{"prompt": "c", "response_format": ' + response_format(nested_schema(100)) + "}",
        # Brackets inside strings are text, not nesting.
        json.dumps({"prompt": "d", "response_format": json.loads(response_format(brackets))}),
        '{"prompt": "last"}',
    ]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    result = run_job(job(data, tiny_folder, tmp_path / "out", sampling={"ignore_eos": False}))
    got = table(tmp_path / "out")
    assert (result.rows, result.errors) == (6, 3)
    assert got[1]["error"] == (
        f"d.jsonl line 2 nests objects and arrays deeper than JSON is read here (about "
        f"{sys.getrecursionlimit()} levels): flatten that row"
    )
    assert (
        got[2]["error"]
        == "bad response_format: its schema is nested too deeply to read: flatten it"
    )
    assert got[3]["error"] == (
        f"bad response_format: structured_outputs.json nests objects and arrays 100 levels deep, "
        f"over the limit of {MAX_SCHEMA_DEPTH}: flatten the schema"
    )
    assert [got[i]["error"] for i in (0, 4, 5)] == [None] * 3
    assert all(got[i]["completion"] for i in (0, 4, 5))
