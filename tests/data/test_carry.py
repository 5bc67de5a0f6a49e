"""Input columns carried through: which ones, their Arrow types (stored or inferred), and a
JSON-lines value that does not fit its column's type as that row's error."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchpage.data import DatasetError, DatasetSpec, iter_windows, validate

UTC = dt.timezone.utc
TYPED = pa.table(
    {
        "prompt": ["a", "b", "c"],
        "answer": ["A", None, "C"],
        "meta": pa.array(
            [{"task": "t1", "tags": ["x", "y"]}, {"task": "t2", "tags": []}, None],
            type=pa.struct([("task", pa.string()), ("tags", pa.list_(pa.string()))]),
        ),
        "when": pa.array(
            [dt.datetime(2024, 1, 2, 3, 4, tzinfo=UTC), None, dt.datetime(2020, 5, 6, tzinfo=UTC)],
            type=pa.timestamp("ms", tz="UTC"),
        ),
        "scores": pa.array([[1.5], [], [2.0, 3.0]], type=pa.list_(pa.float32())),
        "counts": pa.array([[("k", 1)], [], None], type=pa.map_(pa.string(), pa.int64())),
        "max_tokens": [3, 4, 5],
    }
)  # fmt: skip


def carried(spec: DatasetSpec) -> list[dict]:
    return [r.extra for w in iter_windows(spec) for r in w]


def test_parquet_columns_keep_their_types_and_values(tmp_path: Path) -> None:
    f = tmp_path / "t.parquet"
    pq.write_table(TYPED, f)
    info = validate(DatasetSpec(path=str(f), window_rows=2))
    # Everything but the prompt and the override column, in input order, with the stored types.
    assert info.carried == ("answer", "meta", "when", "scores", "counts")
    assert info.carried_schema == TYPED.select(list(info.carried)).schema
    assert (
        carried(DatasetSpec(path=str(f), window_rows=2))
        == TYPED.select(list(info.carried)).to_pylist()
    )


def test_keep_columns_selects_in_its_order_and_empty_carries_none(tmp_path: Path) -> None:
    f = tmp_path / "t.parquet"
    pq.write_table(TYPED, f)
    info = validate(DatasetSpec(path=str(f), keep_columns=["when", "max_tokens", "answer"]))
    assert info.carried == ("when", "max_tokens", "answer")
    assert info.carried_schema == TYPED.select(["when", "max_tokens", "answer"]).schema
    assert validate(DatasetSpec(path=str(f), keep_columns=[])).carried == ()
    with pytest.raises(DatasetError, match=r"keep_columns names \['nope'\].*columns are: prompt"):
        validate(DatasetSpec(path=str(f), keep_columns=["answer", "nope"]))


def test_parquet_files_with_widening_types_unify_and_clashing_ones_refuse(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(
        pa.table({"prompt": ["a"], "x": pa.array([1], pa.int32())}), folder / "1.parquet"
    )
    pq.write_table(
        pa.table({"prompt": ["b"], "x": pa.array([2], pa.int64())}), folder / "2.parquet"
    )
    assert validate(DatasetSpec(path=str(folder))).carried_schema.field("x").type == pa.int64()
    pq.write_table(pa.table({"prompt": ["c"], "x": ["text"]}), folder / "3.parquet")
    with pytest.raises(DatasetError, match="incompatible types"):
        validate(DatasetSpec(path=str(folder)))
    assert validate(DatasetSpec(path=str(folder), keep_columns=[])).carried == ()


def test_csv_columns_are_text(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text("prompt,ref,score\nq1,r1,1.5\nq2,,2\n")
    info = validate(DatasetSpec(path=str(f)))
    assert info.carried_schema == pa.schema([("ref", pa.string()), ("score", pa.string())])
    assert carried(DatasetSpec(path=str(f))) == [
        {"ref": "r1", "score": "1.5"},
        {"ref": "", "score": "2"},
    ]


def test_jsonl_types_are_inferred_and_a_misfit_value_is_its_rows_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("batchpage.data.jsonl_scan._SAMPLE_RECORDS", 3)  # rows 3.. are not sampled
    records = [
        {"prompt": "p0", "ref": {"a": 1, "b": [1, 2]}, "k": 1, "note": None},
        {"prompt": "p1", "ref": {"a": 2}, "k": 2, "note": None},
        {"prompt": "p2", "ref": {"a": 3, "c": "s"}, "k": 3},
        {"prompt": "p3", "ref": {"a": 4}, "k": 1.5, "note": "text"},  # 1.5 is no int64
        {"prompt": "p4", "ref": {"a": 5, "d": 1}, "k": 2.0},  # d: no such field
        {"prompt": "p5", "ref": None, "k": None, "note": 7},  # 7 is no text
        {"prompt": "p6", "ref": {"c": "t"}, "k": 6, "note": "n"},
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = DatasetSpec(path=str(f), window_rows=4)
    ref = pa.struct([("a", pa.int64()), ("b", pa.list_(pa.int64())), ("c", pa.string())])
    schema = pa.schema([("ref", ref), ("k", pa.int64()), ("note", pa.string())])
    assert validate(spec).carried_schema == schema
    rows = [r for w in iter_windows(spec) for r in w]
    failed = {r.index: r.error for r in rows if r.error is not None}
    assert sorted(failed) == [3, 4, 5]
    assert "column 'k' holds '1.5'" in failed[3] and "(int64)" in failed[3]
    assert "column 'ref'" in failed[4] and "column 'note' holds '7'" in failed[5]
    # The misfit value is dropped (the row is still written, with its error); the rest stay.
    assert rows[3].extra == {"ref": {"a": 4}, "k": None, "note": "text"}
    assert rows[4].extra["ref"] is None and rows[4].extra["k"] == 2.0
    # What is carried is exactly what the schema can hold.
    table = pa.Table.from_pylist([r.extra for r in rows], schema=schema)
    assert table.column("k").to_pylist() == [1, 2, 3, None, 2, None, 6]


def test_jsonl_mixed_types_in_the_first_records_refuse_the_column(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "a", "x": 1}) + "\n" + json.dumps({"prompt": "b", "x": "s"}))
    with pytest.raises(DatasetError, match="column 'x' .* different types.*keep_columns"):
        validate(DatasetSpec(path=str(f)))
    assert validate(DatasetSpec(path=str(f), keep_columns=[])).carried == ()


def test_jsonl_columns_that_first_appear_late_are_carried_whatever_the_limit(
    tmp_path: Path,
) -> None:
    """JSON lines have no header: a key first seen on line 1,500, or only on the last line, is
    a column too (typed by its own first values), found by a pass over the whole file even
    when the limit stops reading far earlier, and rows without it hold null."""
    records: list[dict] = [{"prompt": f"p{i}"} for i in range(1600)]
    records[1499]["late"] = 2
    records[1550]["late"] = 2.5
    records[-1]["last"] = {"a": [1], "b": None}
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    schema = pa.schema(
        [
            ("late", pa.float64()),
            ("last", pa.struct([("a", pa.list_(pa.int64())), ("b", pa.null())])),
        ]
    )
    for limit in (None, 10):
        info = validate(DatasetSpec(path=str(f), limit=limit))
        assert info.carried == ("late", "last") and info.carried_schema == schema
        assert info.num_rows == (limit or 1600)
    got = carried(DatasetSpec(path=str(f), window_rows=512))
    assert [r["late"] for r in got] == [r.get("late") for r in records]
    assert [r["last"] for r in got] == [None] * 1599 + [{"a": [1], "b": None}]


def test_a_late_columns_type_comes_from_its_own_first_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column first seen late is typed by its first records that hold it (not by the input's
    first records, where it is absent); a later misfit is still only that row's error."""
    monkeypatch.setattr("batchpage.data.jsonl_scan._SAMPLE_RECORDS", 2)
    records: list[dict] = [{"prompt": f"p{i}"} for i in range(8)]
    records[4]["tag"], records[5]["tag"], records[7]["tag"] = 1, None, 3
    records[6]["tag"] = "x"  # its third value: past the two that type it
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = DatasetSpec(path=str(f), window_rows=3)
    assert validate(spec).carried_schema == pa.schema([("tag", pa.int64())])
    rows = [r for w in iter_windows(spec) for r in w]
    assert [r.extra["tag"] for r in rows] == [None, None, None, None, 1, None, None, 3]
    assert [r.index for r in rows if r.error] == [6]
    assert "column 'tag' holds 'x'" in str(rows[6].error)


@pytest.mark.parametrize("piece_bytes", [1, 1 << 20])
def test_jsonl_types_widen_alike_in_any_pieces_and_a_conflict_names_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece_bytes: int
) -> None:
    """Values are typed a bounded piece of lines at a time; the types come out as if typed in
    one list, and values of no one type refuse the column (if carried) naming the line."""
    monkeypatch.setattr("batchpage.data.jsonl_scan._PIECE_BYTES", piece_bytes)
    records = [
        {"prompt": "a", "k": 1, "s": {"a": 1}, "n": None, "x": 1},
        {"prompt": "b", "k": 2.5, "s": {"b": "t"}, "x": 2},
        {"prompt": "c", "s": None, "n": "text", "x": "three"},  # x: line 3
        {"prompt": "d", "k": None, "x": 4},
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(
        DatasetError, match=rf"column 'x' .*different types.*{re.escape(str(f))} line 3 has "
    ):
        validate(DatasetSpec(path=str(f)))
    info = validate(DatasetSpec(path=str(f), keep_columns=["k", "s", "n"]))
    s = pa.struct([("a", pa.int64()), ("b", pa.string())])
    assert info.carried_schema == pa.schema([("k", pa.float64()), ("s", s), ("n", pa.string())])


def test_jsonl_columns_are_bounded_naming_the_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("batchpage.data.jsonl_scan._MAX_COLUMNS", 3)
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"prompt": "p", f"k{i}": i}) + "\n" for i in range(4)))
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(f))} line 3 brings .* past 3, .*'k2' is the first"
    ):
        validate(DatasetSpec(path=str(f), keep_columns=[]))


def test_input_with_no_json_object_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("[1]\n" * 150 + '{"prompt": "late"}\n')
    with pytest.raises(
        DatasetError, match=rf"no JSON object in the first 100 lines of {re.escape(str(f))}"
    ):
        validate(DatasetSpec(path=str(f)))
    f.write_text("")
    with pytest.raises(DatasetError, match=rf"no JSON object in {re.escape(str(f))}; expected"):
        validate(DatasetSpec(path=str(f)))
