"""Input columns carried through to completions.parquet, with their Arrow types.

By default every input column that the job does not consume (the prompt or messages, the id,
the per-row sampling overrides) is carried, after batchpage's own columns; `dataset.keep_columns`
names them instead ([] for none). Their types are decided before the first row is read, because
they become part of the output's schema and of the job's identity:
- Parquet and HF datasets store them: nested structs, lists, maps and timestamps keep theirs;
- CSV has none: every cell is text;
- JSON lines have none: their columns are those of every line, found by one pass over the
  whole input, and each one's type is inferred from the first records that hold it
  (`jsonl_scan`). A later value that does not fit its column's type losslessly makes that row
  an error (`check_window`) rather than being silently cut (pyarrow would turn 1.5 into 1, or
  drop a struct's unknown key).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from batchpage.data.jsonl_scan import ScannedColumn
from batchpage.data.readers import JSON_LINES, DatasetError, file_schema
from batchpage.data.rows import Row
from batchpage.storage import Store


def carried_columns(
    columns: Sequence[str], used: Sequence[str | None], keep: Sequence[str] | None, where: str
) -> tuple[str, ...]:
    """Which columns to carry: `keep` as given (each must exist), or every column not `used`."""
    if keep is None:
        return tuple(c for c in columns if c not in used)
    keep = list(dict.fromkeys(keep))
    missing = [c for c in keep if c not in columns]
    if missing:
        raise DatasetError(
            f"dataset.keep_columns names {missing}, which {where} does not have; its columns "
            f"are: {', '.join(columns)}"
        )
    return tuple(keep)


def carried_schema(
    fmt: str,
    files: Sequence[str],
    split: str,
    names: Sequence[str],
    scanned: Mapping[str, ScannedColumn] | None = None,
    store: Store | None = None,
) -> pa.Schema:
    """The Arrow schema of the carried columns (see the module docstring). `scanned`: for JSON
    lines, the columns `jsonl_scan.scan_json_lines` found (required for them); a carried one
    whose first values fit no one type is refused, with the scan's message."""
    if not names:
        return pa.schema([])
    stored = file_schema(fmt, files, split, names, store)
    if stored is not None:
        return stored
    if fmt not in JSON_LINES:  # CSV
        return pa.schema([(n, pa.string()) for n in names])
    if scanned is None:
        raise ValueError("carried_schema needs the scan of a JSON-lines input")
    fields = []
    for name in names:
        column = scanned[name]
        if column.conflict is not None:
            raise DatasetError(column.conflict)
        # A column null in all its first records: text, the most common kind of metadata.
        fields.append((name, pa.string() if pa.types.is_null(column.type) else column.type))
    return pa.schema(fields)


def check_window(rows: list[Row], schema: pa.Schema) -> None:
    """Give each row whose carried value does not fit its column's type an error (and a null
    value, so that the row can still be written). For inputs whose types were inferred."""
    for f in schema:
        values = [r.extra.get(f.name) for r in rows]
        if _fits(values, f.type):
            continue
        for row, value in zip(rows, values, strict=True):
            if _fits([value], f.type):
                continue
            row.extra[f.name] = None
            problem = (
                f"column {f.name!r} holds {str(value)[:60]!r} here, which is not of the type its "
                f"first records have ({f.type}); give the column one type, or leave it out with "
                "dataset.keep_columns=[...]"
            )
            row.error = f"{row.error}; {problem}" if row.error else problem


def _fits(values: list[Any], kind: pa.DataType) -> bool:
    try:
        back = pa.array(values, type=kind).to_pylist()
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        return False
    return all(_same(a, b) for a, b in zip(values, back, strict=True))


def _same(a: Any, b: Any) -> bool:
    """Equal as data: a struct's missing and null fields are the same, 2 and 2.0 are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = {k for d in (a, b) for k, v in d.items() if v is not None}
        return all(_same(a.get(k), b.get(k)) for k in keys)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if a != b:
        return False
    both_numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return type(a) is type(b) or both_numbers
