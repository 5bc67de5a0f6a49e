"""The job's output columns: carried input columns with their Arrow types after batchpage's own,
name clashes refused before the model loads, per-row top_p/top_k/seed/stop/n columns applied
as LLM.generate applies the same SamplingParams, chat_template=true with template variables
on a plain question column, and JSON-lines columns that first appear late in the file."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage import LLM, SamplingParams
from batchpage.job import JobConfigError, run_job
from batchpage.job.prompts import row_seed
from batchpage.output import output_schema
from tests.job.test_loop import Spy, never, table, write_jsonl
from tests.job.test_loop import job as tiny_job

UTC = dt.timezone.utc
ENGINE = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 256}


def typed_input(path: Path) -> pa.Table:
    t = pa.table(
        {
            "task": pa.array(
                [{"name": "a", "tags": ["x"]}, None, {"name": "c", "tags": []}],
                type=pa.struct([("name", pa.string()), ("tags", pa.list_(pa.string()))]),
            ),
            "question": ["Hello world", "", "A radix tree"],  # row 1: an error row
            "answer": pa.array([1.5, None, 3.25], type=pa.float32()),
            "at": pa.array(
                [dt.datetime(2024, 1, 2, tzinfo=UTC), None, dt.datetime(2025, 3, 4, tzinfo=UTC)],
                type=pa.timestamp("us", tz="UTC"),
            ),
        }
    )
    pq.write_table(t, path)
    return t


def test_carried_columns_keep_types_and_values(tmp_path: Path, tiny_folder: Path) -> None:
    source = typed_input(tmp_path / "q.parquet")
    cfg = tiny_job(tmp_path / "q.parquet", tiny_folder, tmp_path / "out")
    cfg.dataset.prompt_column = "question"
    run_job(cfg)
    got = pq.read_table(tmp_path / "out" / "completions.parquet")
    carried = source.drop_columns(["question"])
    assert got.schema == pa.schema([*output_schema(), *carried.schema])
    assert got.select(carried.column_names).equals(carried)
    assert got.column("error").to_pylist()[1] == "prompt is empty"

    # keep_columns picks (and orders) them; [] carries none.
    cfg = tiny_job(tmp_path / "q.parquet", tiny_folder, tmp_path / "some")
    cfg.dataset.prompt_column, cfg.dataset.keep_columns = "question", ["at", "task"]
    run_job(cfg)
    some = pq.read_table(tmp_path / "some" / "completions.parquet")
    assert some.schema == pa.schema([*output_schema(), *source.select(["at", "task"]).schema])
    cfg = tiny_job(tmp_path / "q.parquet", tiny_folder, tmp_path / "none")
    cfg.dataset.prompt_column, cfg.dataset.keep_columns = "question", []
    run_job(cfg)
    assert pq.read_schema(tmp_path / "none" / "completions.parquet") == output_schema()


def test_a_name_clash_is_refused_before_the_model_loads(tmp_path: Path, tiny_folder: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "x1", "prompt": "p", "error": "none"}])
    cfg = tiny_job(data, tiny_folder, tmp_path / "out")
    # `id` is the row id by its name; `error` clashes.
    with pytest.raises(JobConfigError, match=r"column\(s\) error would be carried.*keep_columns"):
        run_job(cfg, llm_factory=never)
    cfg.dataset.keep_columns = ["prompt"]
    with pytest.raises(JobConfigError, match="prompt would be carried"):
        run_job(cfg, llm_factory=never)
    assert not (tmp_path / "out").exists()


def test_per_row_sampling_columns_match_llm_generate(tmp_path: Path, tiny_folder: Path) -> None:
    records = [
        {"prompt": "Hello world", "top_p": 0.8, "seed": 11, "n": 2, "stop": None},
        {"prompt": "A radix tree", "top_k": 5, "seed": 3, "stop": "e"},
        {"prompt": "Paged attention", "n": 1, "stop": ["a", "b"], "top_k": None},
        {"prompt": "Bad", "top_p": 1.5},
        {"prompt": "Bad too", "n": 0},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = tiny_job(data, tiny_folder, tmp_path / "out", sampling={"temperature": 0.9})
    run_job(cfg)
    rows = table(tmp_path / "out")
    assert all(isinstance(r["completion"], list) or r["error"] for r in rows)  # n column: lists
    assert "top_p" in rows[3]["error"] and "n must be" in rows[4]["error"]
    llm = LLM(str(tiny_folder), **ENGINE)
    base = {"temperature": 0.9, "max_tokens": 5, "ignore_eos": True}
    want = [
        SamplingParams(**base, top_p=0.8, seed=11, n=2),
        SamplingParams(**base, top_k=5, seed=3, stop=["e"]),
        SamplingParams(**base, stop=["a", "b"], seed=None),
    ]
    for i, params in enumerate(want):
        if params.seed is None:  # no seed column: the row's seed from the job's
            params = params.replace(seed=row_seed(0, i))
        ref = llm.generate(records[i]["prompt"], params, use_tqdm=False)[0]
        assert rows[i]["completion"] == [o.text for o in ref.outputs], i
        assert rows[i]["finish_reason"] == [o.finish_reason for o in ref.outputs]


def test_chat_template_true_with_template_variables(tmp_path: Path, tiny_folder: Path) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if not enable_thinking %}<think></think>{% endif %}"
    )
    path = tmp_path / "t.jinja"
    path.write_text(template)
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "What is 2+2?", "ref": "4"}])
    cfg = tiny_job(
        data,
        tiny_folder,
        tmp_path / "out",
        dataset={
            "prompt_column": "question",
            "chat_template": "true",
            "chat_template_kwargs": {"enable_thinking": False},
        },
        engine={"chat_template": str(path)},
    )
    run_job(cfg)
    row = table(tmp_path / "out")[0]
    assert row["prompt"] == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )
    assert row["ref"] == "4" and row["error"] is None
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["config"]["job"]["dataset"]["chat_template_kwargs"] == {"enable_thinking": False}
    # Another template is another job: refused on resume.
    path.write_text(template.replace("<think></think>", "<think>.</think>"))
    with pytest.raises(JobConfigError, match="chat_template"):
        run_job(cfg, llm_factory=never)


def test_a_column_named_id_is_the_row_id(tmp_path: Path, tiny_folder: Path, caplog) -> None:
    """Without dataset.id_column, a column named `id` keys the rows (and is said in the log);
    its ids must then be unique and present, as a named id column's are."""
    records = [{"id": f"q{i}", "prompt": p, "topic": i} for i, p in enumerate(["a b", "c d", "e"])]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    with caplog.at_level("INFO", logger="batchpage"):
        run_job(tiny_job(data, tiny_folder, tmp_path / "out"))
    assert "column 'id' is the row id" in caplog.text
    rows = pq.read_table(tmp_path / "out" / "completions.parquet").to_pylist()
    assert [(r["id"], r["topic"]) for r in rows] == [("q0", 0), ("q1", 1), ("q2", 2)]
    same = write_jsonl(tmp_path / "s.jsonl", [*records, {"id": "q1", "prompt": "again"}])
    with pytest.raises(JobConfigError, match=r"column 'id' \(the row id: dataset.id_column is not"):
        run_job(tiny_job(same, tiny_folder, tmp_path / "dup"), llm_factory=never)
    holes = write_jsonl(tmp_path / "h.jsonl", [*records, {"id": None, "prompt": "none"}])
    with pytest.raises(JobConfigError, match=r"column 'id' .* is null at rows 3; fill those ids"):
        run_job(tiny_job(holes, tiny_folder, tmp_path / "nul"), llm_factory=never)


def test_a_jsonl_column_first_seen_late_is_carried(tmp_path: Path, tiny_folder: Path) -> None:
    """A key first on line 1,500, and one only on the last line, are output columns with their
    values (null in rows without them). A limited run already has them, null: the columns come
    from the whole file, so raising the limit resumes the same job."""
    records: list[dict] = [{"prompt": f"Hello world {i}"} for i in range(1600)]
    for i in range(1499, 1600, 20):
        records[i]["late"] = f"r{i}"
    records[-1]["last"] = {"score": 0.5}
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    fast = {"sampling": {"max_tokens": 1}, "flush_rows": 1024}
    run_job(tiny_job(data, tiny_folder, out, dataset={"window_rows": 512, "limit": 3}, **fast))
    schema = pa.schema([("late", pa.string()), ("last", pa.struct([("score", pa.float64())]))])
    assert pq.read_schema(out / "completions.parquet") == pa.schema([*output_schema(), *schema])
    assert [(r["late"], r["last"]) for r in table(out)] == [(None, None)] * 3
    spy = Spy()
    result = run_job(tiny_job(data, tiny_folder, out, dataset={"window_rows": 512}, **fast), spy)
    assert (result.rows_resumed, spy.prompts) == (3, 1597)
    rows = table(out)
    assert [r["late"] for r in rows] == [r.get("late") for r in records]
    assert [r["last"] for r in rows] == [None] * 1599 + [{"score": 0.5}]
    assert all(r["error"] is None for r in rows)
