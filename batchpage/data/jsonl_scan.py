"""JSON lines: every column of the input with the Arrow type its values suggest, and the row
count, found by one streaming pass over the whole input.

A JSON-lines file has no header: any line may bring a key that no line before it had, and the
README promises that every input column is carried. So the pass that counts the rows (for the
progress bar's total) also parses them, and keeps per column only its name, its type and how
many values decided it; never a row. Lines are read one at a time, each bounded by
dataset.max_prompt_bytes as when the rows are read for the job, and the values that decide the
types are typed in pieces of bounded size, so that memory does not grow with the input. The
number of distinct columns is bounded too (`_MAX_COLUMNS`): a file whose keys are data (one key
per id) would otherwise grow a column per line.

A column's type is inferred from its first `_SAMPLE_RECORDS` records that hold the key, wherever
in the input they are, as pyarrow infers one type for a list: ints and floats give floats,
structs take the union of their fields, nulls give way to any type (and a column of nulls only
is text, see `carry.carried_schema`). Later values are not typed here: one that does not fit is
that row's error (`carry.check_window`). Values among the first that fit no one type (text and
numbers) are a conflict, which refuses the column only if it is carried.

The pass is the whole input whatever dataset.limit is: the carried columns and their types are
part of the output's schema and of the job's identity, which raising the limit must not change
(rerunning with a higher limit resumes the same job).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchpage.data.readers import DatasetError, jsonl_lines
from batchpage.data.row_ids import IdTally
from batchpage.data.text_checks import unencodable
from batchpage.storage import Store

_SAMPLE_RECORDS = 1000  # the records per column whose values decide its type
# Far more columns than a table meant to be read has, and few enough that the output's schema
# (every window's row group has each column) stays cheap to write.
_MAX_COLUMNS = 4096
# Values awaiting their type are typed together, as one list, once their lines reach this many
# bytes: few pyarrow calls, and never more than a piece of the input held.
_PIECE_BYTES = 16 << 20
_HEAD_LINES = 100  # an input with no JSON object this early is refused without reading on


@dataclass(frozen=True)
class ScannedColumn:
    """One column of a JSON-lines input.

    type: what its first values hold (null: none of them was other than null);
    conflict: why its first values fit no one type (the message for the user), or None.
    """

    type: pa.DataType
    conflict: str | None = None


@dataclass(frozen=True)
class JsonLinesScan:
    """What the pass found: every column in order of first appearance, and the rows (non-blank
    lines, as `readers.open_records` yields them: a line that is no object is a row too)."""

    columns: dict[str, ScannedColumn]
    records: int
    ids: dict[str, IdTally]  # the values of the id columns asked for, row by row


def scan_json_lines(
    files: Sequence[str],
    max_row_bytes: int,
    store: Store | None = None,
    id_columns: Sequence[str] = (),
    limit: int | None = None,
) -> JsonLinesScan:
    """Read `files` once, line by line (streamed through `store`), and return their columns
    and row count (see the module docstring). Raises DatasetError when the input holds no
    JSON object (checked within its first lines, so that a file of another kind is refused
    early) or more than `_MAX_COLUMNS` distinct keys, naming the file and the line.

    Memory: one line (at most max_row_bytes) parsed, the values of about `_PIECE_BYTES` of
    lines awaiting their type, and per column its name and type. Time: one JSON parse of every
    line; values are typed only for each column's first records.
    `id_columns`: columns whose values (of the first `limit` rows) are tallied for the id check,
    so that it needs no pass of its own; each tally holds every id seen."""
    found = _Columns()
    records = 0
    ids = {name: IdTally(limit) for name in dict.fromkeys(id_columns)}
    for path in files:
        for lineno, line in jsonl_lines(path, max_row_bytes, store):
            records += 1
            record = _object(line)
            if record is not None:
                found.add(record, (path, lineno), len(line))
                for name, tally in ids.items():
                    tally.add(records - 1, record.get(name))
            elif not found.objects and records >= _HEAD_LINES:
                raise _no_objects(path, _HEAD_LINES)
    if not found.objects:
        raise _no_objects(files[0])
    return JsonLinesScan(found.finish(), records, ids)


def _object(line: str | int | None) -> dict[str, Any] | None:
    """The line's JSON object, or None for any line that is not one (too long, not UTF-8, not
    JSON, not an object): such a line is that row's error when the rows are read."""
    if not isinstance(line, str):
        return None
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _no_objects(path: str, lines: int | None = None) -> DatasetError:
    where = f"the first {lines} lines of {path}" if lines else str(path)
    return DatasetError(f"no JSON object in {where}; expected JSON lines (one object per line)")


_Where = tuple[str, int]  # a file and a line number in it


class _Columns:
    """The pass's state: per column its type so far, how many values decided it, and the
    values of the current piece still to be typed (with where each came from, to name it)."""

    def __init__(self) -> None:
        self.objects = 0
        self.types: dict[str, pa.DataType] = {}
        self.counts: dict[str, int] = {}
        self.conflicts: dict[str, str] = {}
        self.sampling: set[str] = set()  # columns with fewer values typed than they take
        self.pending: dict[str, list[tuple[Any, _Where]]] = {}
        self.pending_bytes = 0

    def add(self, record: dict[str, Any], where: _Where, size: int) -> None:
        """Take one record: new keys become columns, values of sampling columns wait to be
        typed (a piece of them at a time)."""
        self.objects += 1
        if not record.keys() <= self.types.keys():
            for name in record:  # in the record's order: the output's column order
                if name not in self.types:
                    self._new(name, where)
        if self.sampling:  # past every column's first records, a record costs only the above
            self._sample(record, where, size)

    def _sample(self, record: dict[str, Any], where: _Where, size: int) -> None:
        """Queue the record's values of the columns still being typed; type the queue once
        their lines reach a piece's bytes."""
        taken = False
        for name in self.sampling.intersection(record):
            value = record[name]
            # Values that cannot be written are those rows' errors (rows.make_row), not types.
            self.pending.setdefault(name, []).append((None if unencodable(value) else value, where))
            self.counts[name] += 1
            if self.counts[name] >= _SAMPLE_RECORDS:
                self.sampling.discard(name)
            taken = True
        if taken:
            self.pending_bytes += size
            if self.pending_bytes >= _PIECE_BYTES:
                self._type_pending()

    def finish(self) -> dict[str, ScannedColumn]:
        self._type_pending()
        return {
            name: ScannedColumn(kind, self.conflicts.get(name)) for name, kind in self.types.items()
        }

    def _new(self, name: str, where: _Where) -> None:
        if len(self.types) >= _MAX_COLUMNS:
            path, lineno = where
            raise DatasetError(
                f"{path} line {lineno} brings the input's distinct keys past {_MAX_COLUMNS}, "
                f"the most JSON lines may have as columns ({name!r:.60} is the first over): keep "
                "keys that vary per row (ids, words) inside one object column instead"
            )
        self.types[name] = pa.null()
        self.counts[name] = 0
        self.sampling.add(name)

    def _type_pending(self) -> None:
        """Widen each column's type by the piece's values; on a conflict, name its line and
        stop typing that column."""
        for name, values in self.pending.items():
            kind = _widened(self.types[name], [v for v, _ in values])
            if kind is not None:
                self.types[name] = kind
                continue
            self.conflicts[name] = _conflict(name, self.types[name], values)
            self.sampling.discard(name)
        self.pending.clear()
        self.pending_bytes = 0


def _widened(kind: pa.DataType, values: list[Any]) -> pa.DataType | None:
    """The type that holds what `kind` holds and `values` too, as pyarrow would infer it for
    all of them in one list; None when no type does."""
    if not values:
        return kind
    try:
        found = pa.array(values).type
        both = [pa.schema([("v", kind)]), pa.schema([("v", found)])]
        return pa.unify_schemas(both, promote_options="permissive").field("v").type
    except (pa.ArrowException, OverflowError, RecursionError, TypeError, ValueError):
        return None


def _conflict(name: str, kind: pa.DataType, values: list[tuple[Any, _Where]]) -> str:
    """The message for the first value of the piece (by a binary search over its prefixes,
    since a list that holds a misfit fails to type as a whole) that no type holds with those
    before it."""
    plain = [v for v, _ in values]
    fits, fails = 0, len(plain)  # prefix lengths: values[:fits] type, values[:fails] do not
    while fails - fits > 1:
        mid = (fits + fails) // 2
        if _widened(kind, plain[:mid]) is None:
            fails = mid
        else:
            fits = mid
    before = _widened(kind, plain[:fits]) or kind
    value, (path, lineno) = values[fails - 1]
    misfit = (
        "which no Arrow type holds"
        if pa.types.is_null(before)
        else f"which does not fit {before}, the type of the values before it"
    )
    return (
        f"column {name!r} holds values of different types among its first records: {path} "
        f"line {lineno} has {str(value)[:60]!r}, {misfit}; give it one type, or leave it out "
        "of the output with dataset.keep_columns=[...]"
    )
