"""CSV (and TSV) files through Arrow's streaming reader: every cell as bytes, one block of
records at a time, read from the dataset's `Store` (a local file or an object, .gz or not)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.csv as pacsv

from batchpage.data.input_files import DatasetError, open_binary
from batchpage.storage import Store

_SKIP_CHUNK = 1 << 20  # bytes read at a time when looking for over-long records
_CSV_MARKS = re.compile(rb'["\n]')  # what decides where a CSV record ends


@contextlib.contextmanager
def open_csv(
    store: Store, path: str, columns: list[str] | None, max_bytes: int
) -> Iterator[pacsv.CSVStreamingReader]:
    """A streaming reader of the named columns (all of them, as Arrow infers, for None), whose
    file stays open until the block ends."""
    delimiter = "\t" if ".tsv" in store.name(path).lower() else ","
    # Every column is read as text: type inference per block would fail on mixed columns, and
    # overrides are parsed per row instead (a bad cell is that row's error, not the job's). As
    # bytes, decoded per cell (text_checks.records_of): Arrow's own decoding fails the whole
    # file on one cell that is not UTF-8.
    convert = pacsv.ConvertOptions()
    if columns is not None:
        convert = pacsv.ConvertOptions(
            include_columns=columns,
            column_types={c: pa.binary() for c in columns},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        )
    with open_binary(store, path) as fp:
        yield pacsv.open_csv(
            fp,
            # A block holds whole records: one of max_bytes fits, a longer one fails the file.
            read_options=pacsv.ReadOptions(block_size=max_bytes + 1),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
            convert_options=convert,
        )


def csv_header(store: Store, path: str, max_bytes: int) -> list[str]:
    try:
        with open_csv(store, path, None, max_bytes) as reader:
            return reader.schema.names
    except pa.ArrowInvalid as e:
        raise csv_error(e, store, path, max_bytes) from e


def csv_batches(
    store: Store, path: str, columns: list[str], max_bytes: int
) -> Iterator[pa.RecordBatch]:
    """The file's records in Arrow batches; DatasetError for a file Arrow cannot parse."""
    try:
        with open_csv(store, path, columns, max_bytes) as reader:
            yield from reader
    except pa.ArrowInvalid as e:
        # A structurally broken CSV (wrong field count) has no row to blame reliably.
        raise csv_error(e, store, path, max_bytes) from e


def csv_error(e: pa.ArrowInvalid, store: Store, path: str, max_bytes: int) -> DatasetError:
    """The file's error for what Arrow's CSV reader refused; a record longer than its block (in
    Arrow's words, one that straddles two block boundaries) is found and named by its line."""
    found = _long_csv_record(store, path, max_bytes) if "straddl" in str(e) else None
    if found is None:
        return DatasetError(f"{path} is not valid CSV: {e}")
    line, size, longest = found
    return DatasetError(
        f"{path} has CSV records over dataset.max_prompt_bytes={max_bytes} bytes, which the CSV "
        f"reader cannot skip (the first starts on line {line}, {size:,} bytes; the longest is "
        f"{longest:,}): shorten them, set dataset.max_prompt_bytes={longest} or more, or give "
        "the data as JSONL or Parquet, where such a row is its own error"
    )


def _long_csv_record(store: Store, path: str, bound: int) -> tuple[int, int, int] | None:
    """(line, bytes) of the first CSV record longer than `bound` bytes (its newline not
    counted) and the bytes of the longest, or None if none is longer. One streaming pass that
    follows quotes as Arrow's reader does: a newline between quotes is inside the record, and
    a doubled quote inside quotes flips twice."""
    first: tuple[int, int] | None = None
    longest = size = 0
    line = start = 1  # the line being read, and the one the current record started on
    quoted = False
    with open_binary(store, path) as fp:
        while chunk := fp.read(_SKIP_CHUNK):
            counted = 0  # bytes of this chunk already added to size
            for mark in _CSV_MARKS.finditer(chunk):
                if mark.group() == b'"':
                    quoted = not quoted
                    continue
                line += 1
                if quoted:
                    continue
                size += mark.start() - counted
                counted = mark.end()
                if size > bound and first is None:
                    first = (start, size)
                longest, size, start = max(longest, size), 0, line
            size += len(chunk) - counted
    if size > bound and first is None:  # the last record, without a newline
        first = (start, size)
    return None if first is None else (*first, max(longest, size))
