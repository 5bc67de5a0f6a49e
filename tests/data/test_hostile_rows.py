"""Values no UTF-8 writer takes (a lone surrogate spelled in JSON, bytes that are not UTF-8 in a
Parquet or CSV cell) in a prompt, a chat, an id, a carried column or an OpenAI Batch custom_id:
that row's error, naming the row and the column, and the job writes every other row, through
the real job, and again when rerun."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.data import DatasetSpec, iter_rows
from batchpage.data.text_checks import InvalidText, records_of, text_error, unencodable
from batchpage.job import run_job
from tests.job.test_loop import job, table
from tests.job.test_run_cli import cli, tiny_job_args

SURROGATE = '"bad \\ud800 x"'  # JSON text: json.loads gives a str holding a lone surrogate


def invalid_utf8(values: list[bytes]) -> pa.Array:
    """A string column holding exactly these bytes (Arrow does not check them)."""
    binary = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(values), binary.buffers())


def errors(out: Path) -> list[str | None]:
    return [r["error"] for r in table(out)]


def rerun_resumes(cfg: Any) -> None:
    result = run_job(cfg)
    assert (result.rows_generated, result.errors) == (0, 1)


def test_the_checks_name_where_the_bad_text_is() -> None:
    assert unencodable(["ok", {"content": "é \ud800"}]) == (
        "[1].content",
        "a lone surrogate \\ud800 at character 2, which UTF-8 cannot hold",
    )
    assert unencodable({"\udcff": 1})[0] == " (a key)"  # type: ignore[index]
    assert unencodable({"a": ["fine", "é"], "b": 2}) is None
    error = text_error(7, "meta", "x\udc80")
    assert error is not None and error.startswith("row 7, column 'meta': a lone surrogate")
    batch = pa.record_batch({"p": invalid_utf8([b"ok", b"\xffno"])})
    got = records_of(batch)
    assert got[0] == {"p": "ok"} and isinstance(got[1]["p"], InvalidText)
    assert got[1]["p"].shown == "\\xffno" and "byte 0xff at 0" in got[1]["p"].reason


def test_a_lone_surrogate_in_a_prompt_is_that_rows_error(tmp_path: Path, tiny_folder) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(f'{{"prompt": "hello"}}\n{{"prompt": {SURROGATE}}}\n{{"prompt": "world"}}\n')
    cfg = job(data, tiny_folder, tmp_path / "out")
    result = run_job(cfg)
    assert (result.rows, result.errors) == (3, 1)
    got = table(tmp_path / "out")
    assert got[1]["error"].startswith("row 1, column 'prompt': a lone surrogate \\ud800")
    assert got[1]["prompt"] is None and got[0]["completion"] and got[2]["completion"]
    rerun_resumes(cfg)


def test_the_command_line_job_finishes_with_exit_0(tmp_path: Path, tiny_folder) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(f'{{"prompt": "hello", "meta": {SURROGATE}}}\n{{"prompt": "world"}}\n')
    out = tmp_path / "out"
    for _ in range(2):  # the rerun resumes and ends the same way
        proc = cli(tiny_job_args(data, tiny_folder, out), tmp_path, stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    got = table(out)
    assert got[0]["error"].startswith("row 0, column 'meta': a lone surrogate")
    assert got[0]["meta"] is None and got[1]["error"] is None and got[1]["completion"]


def test_a_chat_an_id_and_a_carried_value(tmp_path: Path, tiny_folder) -> None:
    chat = f'[{{"role": "user", "content": {SURROGATE}}}]'
    lines = [
        '{"key": "a", "messages": [{"role": "user", "content": "hi"}], "meta": "m"}',
        f'{{"key": "b", "messages": {chat}, "meta": "m"}}',
        f'{{"key": {SURROGATE}, "messages": [{{"role": "user", "content": "hi"}}], "meta": "m"}}',
        f'{{"key": "d", "messages": [{{"role": "user", "content": "hi"}}], "meta": {SURROGATE}}}',
        '{"key": "e", "messages": [{"role": "user", "content": "yo"}], "meta": "m"}',
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    dataset = {"messages_column": "messages", "prompt_column": None, "id_column": "key"}
    cfg = job(data, tiny_folder, tmp_path / "out", dataset=dataset)
    run_job(cfg)
    got = table(tmp_path / "out")
    assert [r["id"] for r in got] == ["a", "b", "bad \\ud800 x", "d", "e"]
    assert got[1]["error"].startswith("row 1, column 'messages' at [0].content: a lone surr")
    assert got[2]["error"].startswith("row 2, column 'key': a lone surrogate")
    assert got[3]["error"].startswith("row 3, column 'meta'") and got[3]["meta"] is None
    assert [r["error"] is None for r in got] == [True, False, False, False, True]
    assert got[0]["completion"] and got[4]["completion"] and got[4]["meta"] == "m"


def test_a_custom_id_is_caught_when_read_not_at_the_flush(tmp_path: Path, tiny_folder) -> None:
    def line(custom_id: str, prompt: str = '"hi"') -> str:
        body = f'{{"prompt": {prompt}, "max_tokens": 2}}'
        return f'{{"custom_id": {custom_id}, "url": "/v1/completions", "body": {body}}}'

    data = tmp_path / "b.jsonl"
    data.write_text("\n".join([line('"a"'), line(SURROGATE), line('"c"', SURROGATE)]) + "\n")
    cfg = job(data, tiny_folder, tmp_path / "out")
    result = run_job(cfg)
    assert (result.rows, result.errors) == (3, 2)
    got = table(tmp_path / "out")
    assert got[1]["id"] is None and "row 1, column 'custom_id': a lone surr" in got[1]["error"]
    assert got[2]["id"] == "c" and "row 2, column 'body' at prompt: a lone" in got[2]["error"]
    failed = (tmp_path / "out" / "batch_errors.jsonl").read_text().splitlines()
    failed = [json.loads(x) for x in failed]
    assert [x["custom_id"] for x in failed] == [None, "c"]
    done = (tmp_path / "out" / "batch_output.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in done] == ["a"]


def test_parquet_cells_that_are_not_utf8(tmp_path: Path, tiny_folder) -> None:
    data = tmp_path / "d.parquet"
    prompts = invalid_utf8([b"hello", b"bad \xff x", b"world", b"fine"])
    meta = invalid_utf8([b"m", b"m", b"m", b"\xc3("])
    pq.write_table(pa.table({"prompt": prompts, "meta": meta}), data)
    cfg = job(data, tiny_folder, tmp_path / "out")
    result = run_job(cfg)
    assert (result.rows, result.errors) == (4, 2)
    got = table(tmp_path / "out")
    assert got[1]["error"].startswith("row 1, column 'prompt': byte 0xff at 4 is not UTF-8")
    assert got[3]["error"].startswith("row 3, column 'meta': byte 0xc3 at 0 is not UTF-8")
    assert got[3]["meta"] is None and got[3]["prompt"] == "fine" and got[1]["prompt"] is None
    assert got[0]["completion"] and got[2]["completion"] and got[0]["meta"] == "m"


def test_csv_cells_that_are_not_utf8(tmp_path: Path) -> None:
    data = tmp_path / "d.csv"
    data.write_bytes(b"prompt,meta\nhello,a\nbad \xff x,b\nworld,\xfe\n")
    rows = list(iter_rows(DatasetSpec(path=str(data))))
    assert [r.prompt for r in rows] == ["hello", None, "world"]
    assert rows[1].error.startswith("row 1, column 'prompt': byte 0xff at 4 is not UTF-8")
    assert rows[2].error.startswith("row 2, column 'meta': byte 0xfe at 0")
    assert rows[0].extra == {"meta": "a"} and rows[2].extra == {"meta": None}


def test_a_jsonl_line_that_is_not_utf8_is_that_rows_error_with_or_without_ids(
    tmp_path: Path,
) -> None:
    """With an id column (named `id`, or chosen by dataset.id_column) as without one, the line
    is that row's error, as the reader words it, and every other row is read; its id is null
    where the input has ids (the row index might be another row's id)."""
    lines = [
        b'{"id": "a", "key": "a", "prompt": "hello"}',
        b'{"id": "b", "key": "b", "prompt": "\xff"}',
        b'{"id": "c", "key": "c", "prompt": "world"}',
    ]
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    said = "d.jsonl line 2 is not valid UTF-8: fix or re-encode that line"
    for spec, ids in [
        (DatasetSpec(path=str(data)), ["a", None, "c"]),
        (DatasetSpec(path=str(data), id_column="key"), ["a", None, "c"]),
        (DatasetSpec(path=str(data), keep_columns=[]), ["a", None, "c"]),
    ]:
        rows = list(iter_rows(spec))
        assert [r.error for r in rows] == [None, said, None]
        assert [r.id for r in rows] == ids and [r.prompt for r in rows] == ["hello", None, "world"]
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(b'{"prompt": "hello"}\n{"prompt": "\xff"}\n{"prompt": "world"}\n')
    rows = list(iter_rows(DatasetSpec(path=str(plain))))
    assert [r.error for r in rows] == [None, said.replace("d.jsonl", "plain.jsonl"), None]
    assert [r.id for r in rows] == ["0", "1", "2"]


def test_a_jsonl_line_that_is_not_utf8_in_a_job_with_ids_exits_0(
    tmp_path: Path, tiny_folder
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "\xff"}\n')
    out = tmp_path / "out"
    proc = cli(tiny_job_args(data, tiny_folder, out), tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    got = table(out)
    assert [r["id"] for r in got] == ["a", None] and got[0]["completion"]
    assert got[1]["error"] == "d.jsonl line 2 is not valid UTF-8: fix or re-encode that line"
