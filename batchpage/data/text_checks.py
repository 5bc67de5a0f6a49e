"""Row values that cannot be written as UTF-8, found when a row is read rather than when its
output is written.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``), which Python decodes into a `str` that
no UTF-8 encoder (Arrow, the tokenizer, a JSON-lines writer) accepts; a Parquet or CSV cell can
hold bytes that are not UTF-8 at all. Either would end the job when the row reaches the
tokenizer or the shard writer. Readers turn an undecodable stored cell into `InvalidText`, and
`unencodable` finds either kind anywhere inside a value (nested lists and mappings, keys
included), so the row can carry it as its error, naming the column and where in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(frozen=True)
class InvalidText:
    """A stored text cell whose bytes are not UTF-8: `shown` is the text with the bad bytes
    escaped (enough to find the cell), `reason` where the decoding failed."""

    shown: str
    reason: str

    @classmethod
    def of(cls, raw: bytes, error: UnicodeDecodeError) -> InvalidText:
        shown = raw.decode("utf-8", "backslashreplace")
        return cls(shown, f"byte {raw[error.start]:#04x} at {error.start} is not UTF-8")


def unencodable(value: Any, where: str = "") -> tuple[str, str] | None:
    """(where inside `value`, e.g. `[1].content`, and what is wrong) for the first string in it,
    keys included, that cannot be written as UTF-8; None when all can."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = value[e.start : e.end].encode("unicode_escape").decode("ascii")
            return where, f"a lone surrogate {bad} at character {e.start}, which UTF-8 cannot hold"
        return None
    if isinstance(value, InvalidText):
        return where, value.reason
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = unencodable(key, f"{where} (a key)") or unencodable(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = unencodable(item, f"{where}[{i}]")
            if found:
                return found
    return None


def text_error(index: int, column: str, value: Any) -> str | None:
    """The row error for a column whose value cannot be written as UTF-8, or None."""
    found = unencodable(value)
    if found is None:
        return None
    where, problem = found
    return (
        f"row {index}, column {column!r}{' at ' + where.lstrip('.') if where else ''}: {problem}; "
        "fix or re-encode that value in the input"
    )


def utf8_size(text: str, bound: int) -> int | None:
    """The UTF-8 size of `text` if it is over `bound` bytes, else None (cheap for short text)."""
    if len(text) * 4 <= bound:  # no character takes more than 4 bytes
        return None
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return size if size > bound else None


def size_error(what: str, size: int, bound: int) -> str:
    return (
        f"{what} is {size:,} bytes, over dataset.max_prompt_bytes={bound}: shorten it, or raise "
        "the bound"
    )


def escaped(value: Any) -> str:
    """An id that cannot be written as it is, as text that can (backslash escapes), so that the
    output row still names its input row."""
    if isinstance(value, InvalidText):
        return value.shown
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def records_of(batch: pa.RecordBatch | pa.Table, text_from_bytes: bool = False) -> list[dict]:
    """The rows of an Arrow batch as dicts. A text cell whose bytes are not UTF-8 (Arrow does
    not check Parquet's strings when reading) becomes `InvalidText` in place, instead of failing
    the whole batch. text_from_bytes: binary columns hold text (CSV cells read as bytes, so that
    one bad cell is not the whole file's error) and are decoded here the same way."""
    if not text_from_bytes:
        try:
            return batch.to_pylist()
        except UnicodeDecodeError:
            pass
    columns = [_column_values(batch.column(n), text_from_bytes) for n in batch.schema.names]
    return [dict(zip(batch.schema.names, row, strict=True)) for row in zip(*columns, strict=True)]


def _column_values(column: pa.Array | pa.ChunkedArray, text_from_bytes: bool) -> list[Any]:
    if text_from_bytes and pa.types.is_binary(column.type):
        return [_decode(v) for v in column.to_pylist()]
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values: list[Any] = []
        for cell in column:
            try:
                values.append(cell.as_py())
            except UnicodeDecodeError as e:
                values.append(InvalidText.of(bytes(e.object), e))
        return values


def _decode(value: bytes | None) -> str | InvalidText | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        return InvalidText.of(value, e)
