"""Format readers behind `batchpage.data.spec`: pick a format, peek at columns, stream records.

Records are plain dicts (column -> Python value). A record that cannot be parsed at all (a bad
JSONL line) comes out as a `str` saying why, in its place, so that row indices stay true to the
input and the row still gets an output row. Nothing here reads more than a window at a time,
except `load_dataset` on raw files, which (as HF datasets always does) converts them to its Arrow
cache once and then memory-maps it.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from batchpage.data.text_checks import records_of

_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl",
    ".ndjson.gz": "jsonl",
    ".json": "json",  # JSON lines or one JSON array: settled by peeking at the first character
    ".json.gz": "jsonl",
    ".csv": "csv",
    ".tsv": "csv",
    ".csv.gz": "csv",
    ".tsv.gz": "csv",
}
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_HF_BUILDERS = {"parquet": "parquet", "jsonl": "json", "csv": "csv"}
# dataset.max_prompt_bytes' default: the most bytes one input row (a JSONL line, a CSV record)
# or one prompt may take. A prompt this long is ~1M tokens, past any model's context, and the
# bound keeps one row's memory (reading, rendering, tokenizing) far below the machine's.
DEFAULT_MAX_PROMPT_BYTES = 4 << 20
_SKIP_CHUNK = 1 << 20  # the rest of an over-long line is skipped this much at a time
_CSV_MARKS = re.compile(rb'["\n]')  # what decides where a CSV record ends
JSON_LINES = ("jsonl", "openai_batch")  # formats read line by line as JSON objects


class DatasetError(ValueError):
    """The dataset cannot be read at all; the message names the problem and the fix."""


def resolve_format(fmt: str, paths: list[Path]) -> tuple[str, list[Path]]:
    """Settle `auto` and expand folders into their data files (sorted, hidden files skipped)."""
    if len(paths) == 1 and paths[0].is_dir() and _is_saved_hf(paths[0]):
        if fmt not in ("auto", "hf"):
            raise DatasetError(f"{paths[0]} is a saved HF dataset; set dataset.format=hf (or auto)")
        return "hf", paths
    if fmt == "hf":
        return fmt, paths  # load_dataset takes a data folder or files as they are
    if fmt == "openai_batch":
        return fmt, resolve_format("jsonl", paths)[1]
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _visible(f, p))
            files += [f for f in found if _file_format(f) is not None]
        else:
            files.append(p)
    if not files:
        raise DatasetError(f"{paths[0]} holds no data files (.parquet, .jsonl, .csv, .json)")
    if fmt != "auto":
        return fmt, [f for f in files if _file_format(f) in (fmt, None)] or files
    kinds = {f: _file_format(f) for f in files}
    unknown = [str(f) for f, k in kinds.items() if k is None]
    if unknown:
        raise DatasetError(
            f"cannot tell the format of {unknown[0]} from its name; "
            "set dataset.format=parquet|jsonl|csv|hf"
        )
    found_kinds = sorted(set(kinds.values()))
    if len(found_kinds) > 1:
        raise DatasetError(
            f"{paths[0]} mixes formats {found_kinds}; point dataset.path at one kind "
            "(e.g. a glob like data/*.parquet) or set dataset.format"
        )
    kind = found_kinds[0]
    return ("hf", files) if kind == "json-array" else (kind, files)


def peek_columns(
    fmt: str, files: list[Path], split: str, max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES
) -> tuple[list[str], int | None]:
    """Column names (those every file has) and the row count where it is free to know. Not
    for JSON lines, which have no header: `jsonl_scan.scan_json_lines` reads their columns."""
    if fmt in JSON_LINES:
        raise ValueError("the columns of JSON lines come from jsonl_scan.scan_json_lines")
    try:
        if fmt == "parquet":
            metas = [pq.ParquetFile(f) for f in files]
            names = _common_names(files, [m.schema_arrow.names for m in metas])
            return names, sum(m.metadata.num_rows for m in metas)
        if fmt == "csv":
            headers = [_csv_header(f, max_row_bytes) for f in files]
            return _common_names(files, headers), None
        if fmt == "hf":
            ds = _load_hf(files, split)
            return list(ds.column_names), len(ds)
    except DatasetError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DatasetError(f"cannot read {files[0]} as {fmt}: {e}") from e
    raise DatasetError(f"unknown dataset format {fmt!r}")


def _common_names(files: list[Path], names: list[list[str]]) -> list[str]:
    """The column names every file has, in the first file's order. A file with two columns of
    one name is refused: a row holds one value per name, so one of them would be dropped."""
    for f, found in zip(files, names, strict=True):
        twice = sorted({n for n in found if found.count(n) > 1})
        if twice:
            raise DatasetError(
                f"{f} has more than one column named {', '.join(map(repr, twice))}: rename "
                "them so that each column's name is its own"
            )
    return [n for n in names[0] if all(n in other for other in names[1:])]


def file_schema(fmt: str, files: list[Path], split: str, names: Sequence[str]) -> pa.Schema | None:
    """The Arrow types of the named columns as a typed input stores them (Parquet: unified over
    its files; HF datasets: its features); None for JSON lines and CSV, which store none."""
    if fmt not in ("parquet", "hf"):
        return None
    try:
        if fmt == "hf":
            found = _load_hf(files, split).features.arrow_schema
            return pa.schema([found.field(n) for n in names])
        schemas = [pq.read_schema(f) for f in files]
        return pa.unify_schemas(
            [pa.schema([s.field(n) for n in names]) for s in schemas],
            promote_options="permissive",
        )
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(
            f"the columns to carry into the output ({', '.join(names)}) have incompatible types "
            f"across the files of {files[0].parent} ({e}); point dataset.path at files of one "
            "schema, or choose the columns with dataset.keep_columns=[...]"
        ) from e


def is_openai_batch(path: Path, max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES) -> bool:
    """Whether the first JSON object of a JSON-lines file is an OpenAI Batch request line."""
    for _, line in jsonl_lines(path, max_row_bytes):
        try:
            obj = json.loads(line) if isinstance(line, str) else None
        except (json.JSONDecodeError, RecursionError):  # that line's error when it is read
            continue
        if isinstance(obj, dict):
            return "custom_id" in obj and "body" in obj
    return False


def open_records(
    fmt: str,
    files: list[Path],
    split: str,
    columns: list[str],
    window_rows: int,
    max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> Iterator[dict[str, Any] | str]:
    """Stream records of the given columns in input order, one window of rows in memory. A JSONL
    line longer than max_row_bytes comes out as its error without being held in memory; a CSV
    record longer than it may fail the file (Arrow's reader cannot skip one), naming its line."""
    if fmt == "parquet":
        for f in files:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=window_rows, columns=columns):
                yield from records_of(batch)
    elif fmt in JSON_LINES:
        for f in files:
            yield from _jsonl_records(f, max_row_bytes)
    elif fmt == "csv":
        for f in files:
            try:
                for batch in _open_csv(f, columns, max_row_bytes):
                    yield from records_of(batch, text_from_bytes=True)
            except pa.ArrowInvalid as e:
                # A structurally broken CSV (wrong field count) has no row to blame reliably.
                raise _csv_error(e, f, max_row_bytes) from e
    elif fmt == "hf":
        ds = _load_hf(files, split).select_columns(columns)
        # Arrow tables straight off the memory-mapped cache: no pandas, one window at a time.
        for batch in ds.with_format("arrow").iter(batch_size=window_rows):
            yield from records_of(batch)
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}")


# --- helpers -----------------------------------------------------------------------------------


def _file_format(path: Path) -> str | None:
    name = path.name.lower()
    for ext in sorted(_EXTENSIONS, key=len, reverse=True):  # .jsonl.gz before .gz-less forms
        if name.endswith(ext):
            kind = _EXTENSIONS[ext]
            return _json_kind(path) if kind == "json" else kind
    return None


def _json_kind(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    return "json-array" if head.startswith("[") else "jsonl"


def _visible(f: Path, root: Path) -> bool:
    # Skip hidden/temp files and Spark-style markers (_SUCCESS) anywhere below the root.
    return not any(part.startswith((".", "_")) for part in f.relative_to(root).parts)


def _is_saved_hf(folder: Path) -> bool:
    return any((folder / m).exists() for m in _HF_MARKERS)


def _open_binary(path: Path) -> BinaryIO:
    # Bytes, not text: each line is decoded on its own, so one line of bad UTF-8 is that row's
    # error (naming the line) instead of silently replaced characters or a failed job.
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def jsonl_lines(path: Path, max_bytes: int) -> Iterator[tuple[int, str | int | None]]:
    """(line number, text) of each non-blank line; text is None for a line that is not UTF-8,
    and the line's length for one longer than max_bytes (never held in memory whole)."""
    with _open_binary(path) as fp:
        for lineno, raw in enumerate(bounded_lines(fp, max_bytes), 1):
            if isinstance(raw, int):
                yield lineno, raw
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield lineno, None
                continue
            if line.strip():  # blank lines are not rows
                yield lineno, line


def bounded_lines(fp: BinaryIO, max_bytes: int) -> Iterator[bytes | int]:
    """The lines of `fp` (newline excluded from the bound); for a line longer than max_bytes,
    its length instead, having read past it in chunks without keeping it."""
    while line := fp.readline(max_bytes + 1):
        if len(line) <= max_bytes or line.endswith(b"\n"):
            yield line
            continue
        length = len(line)
        while not line.endswith(b"\n") and (line := fp.readline(_SKIP_CHUNK)):
            length += len(line)
        yield length - line.endswith(b"\n")


def _jsonl_records(path: Path, max_bytes: int) -> Iterator[dict[str, Any] | str]:
    for lineno, line in jsonl_lines(path, max_bytes):
        if line is None:
            yield f"{path.name} line {lineno} is not valid UTF-8: fix or re-encode that line"
            continue
        if isinstance(line, int):
            yield (
                f"{path.name} line {lineno} is {line:,} bytes, over dataset.max_prompt_bytes="
                f"{max_bytes}: shorten that row, or raise the bound"
            )
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path.name} line {lineno} is not valid JSON ({e.msg})"
            continue
        except RecursionError:  # json.loads recurses once per level
            yield (
                f"{path.name} line {lineno} nests objects and arrays deeper than JSON is read "
                f"here (about {sys.getrecursionlimit()} levels): flatten that row"
            )
            continue
        yield obj if isinstance(obj, dict) else f"{path.name} line {lineno} is not an object"


def count_records(
    fmt: str,
    files: list[Path],
    limit: int | None = None,
    max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> int:
    """Rows of a JSONL or CSV input (at most `limit`), by one streaming pass that parses no
    JSON value: what the progress bar's total needs. JSONL counts non-blank lines; CSV counts
    the rows its parser finds."""
    if fmt not in (*JSON_LINES, "csv"):
        raise ValueError(f"count_records counts jsonl and csv, not {fmt}")
    total = 0
    for f in files:
        if fmt in JSON_LINES:
            with _open_binary(f) as fp:
                for raw in bounded_lines(fp, max_row_bytes):
                    total += isinstance(raw, int) or bool(raw.strip())
                    if limit is not None and total >= limit:
                        return limit
            continue
        try:
            for batch in _open_csv(f, [], max_row_bytes):
                total += batch.num_rows
                if limit is not None and total >= limit:
                    return limit
        except pa.ArrowInvalid as e:
            raise _csv_error(e, f, max_row_bytes) from e
    return total


def _csv_header(path: Path, max_bytes: int) -> list[str]:
    try:
        return _open_csv(path, None, max_bytes).schema.names
    except pa.ArrowInvalid as e:
        raise _csv_error(e, path, max_bytes) from e


def _csv_error(e: pa.ArrowInvalid, path: Path, max_bytes: int) -> DatasetError:
    """The file's error for what Arrow's CSV reader refused; a record longer than its block (in
    Arrow's words, one that straddles two block boundaries) is found and named by its line."""
    found = _long_csv_record(path, max_bytes) if "straddl" in str(e) else None
    if found is None:
        return DatasetError(f"{path} is not valid CSV: {e}")
    line, size, longest = found
    return DatasetError(
        f"{path} has CSV records over dataset.max_prompt_bytes={max_bytes} bytes, which the CSV "
        f"reader cannot skip (the first starts on line {line}, {size:,} bytes; the longest is "
        f"{longest:,}): shorten them, set dataset.max_prompt_bytes={longest} or more, or give "
        "the data as JSONL or Parquet, where such a row is its own error"
    )


def _long_csv_record(path: Path, bound: int) -> tuple[int, int, int] | None:
    """(line, bytes) of the first CSV record longer than `bound` bytes (its newline not
    counted) and the bytes of the longest, or None if none is longer. One streaming pass that
    follows quotes as Arrow's reader does: a newline between quotes is inside the record, and
    a doubled quote inside quotes flips twice."""
    first: tuple[int, int] | None = None
    longest = size = 0
    line = start = 1  # the line being read, and the one the current record started on
    quoted = False
    with _open_binary(path) as fp:
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


def _open_csv(path: Path, columns: list[str] | None, max_bytes: int) -> pacsv.CSVStreamingReader:
    delimiter = "\t" if ".tsv" in path.name.lower() else ","
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
    return pacsv.open_csv(
        path,
        # A block holds whole records: one of max_bytes fits, a longer one fails the file.
        read_options=pacsv.ReadOptions(block_size=max_bytes + 1),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
        convert_options=convert,
    )


def _load_hf(files: list[Path], split: str) -> Any:
    import datasets  # imported here: it is slow to import and only this format needs it

    try:
        if len(files) == 1 and files[0].is_dir() and _is_saved_hf(files[0]):
            ds = datasets.load_from_disk(str(files[0]))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DatasetError(
                        f"split {split!r} not in {files[0]}; its splits are: {', '.join(ds)}. "
                        "Set dataset.split=..."
                    )
                ds = ds[split]
            return ds
        if len(files) == 1 and files[0].is_dir():
            return datasets.load_dataset(str(files[0]), split=split)
        kind = _file_format(files[0])
        builder = _HF_BUILDERS.get("jsonl" if kind == "json-array" else kind or "", "json")
        kwargs = {"sep": "\t"} if ".tsv" in files[0].name.lower() else {}
        return datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split=split, **kwargs
        )
    except DatasetError:
        raise
    except ValueError as e:
        # e.g. an unknown split: HF's message lists the splits that exist.
        raise DatasetError(f"cannot load {files[0]} with HF datasets (split={split!r}): {e}") from e
