"""Format readers behind `batchpage.data.spec`: pick a format, peek at columns, stream records.

Records are plain dicts (column -> Python value). A record that cannot be parsed at all (a bad
JSONL line) comes out as a `str` saying why, in its place, so that row indices stay true to the
input and the row still gets an output row. Nothing here reads more than a window at a time,
except `load_dataset` on raw files, which (as HF datasets always does) converts them to its Arrow
cache once and then memory-maps it.

Files are named by strings and read through a `Store` (input_files.py): a local path and a URL
(s3://, gs://, ...) take the same code, one file open at a time. Each function takes the store
that holds the files; None picks it from the first file's form, with default settings. HF
datasets are read from local disk only.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from batchpage.data.csv_files import csv_batches, csv_header
from batchpage.data.input_files import (
    DatasetError,
    data_files_under,
    is_local,
    open_binary,
    open_parquet,
    store_of,
)
from batchpage.data.text_checks import records_of
from batchpage.storage import Store

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
JSON_LINES = ("jsonl", "openai_batch")  # formats read line by line as JSON objects
# What works from object storage (HF datasets are read from local disk only).
URL_FORMATS = "Parquet, JSONL (.jsonl, .jsonl.gz), CSV or OpenAI Batch files"


def resolve_format(
    fmt: str, paths: Sequence[str], store: Store | None = None
) -> tuple[str, list[str]]:
    """Settle `auto` and expand folders (prefixes) into their data files (in reading order,
    hidden files skipped). HF datasets are read from local disk only: at a URL they are
    refused, naming the formats that work there."""
    paths = [str(p) for p in paths]
    store = store_of(paths[0], store)
    if len(paths) == 1 and store.is_dir(paths[0]) and _is_saved_hf(store, paths[0]):
        if fmt not in ("auto", "hf"):
            raise DatasetError(f"{paths[0]} is a saved HF dataset; set dataset.format=hf (or auto)")
        return "hf", _local_only(store, "hf", paths)
    if fmt == "hf":
        return fmt, _local_only(store, fmt, paths)  # load_dataset takes a folder or files as is
    if fmt == "openai_batch":
        return fmt, resolve_format("jsonl", paths, store)[1]
    files: list[str] = []
    for p in paths:
        if store.is_dir(p):
            files += [f for f in data_files_under(store, p) if _file_format(store, f) is not None]
        else:
            files.append(p)
    if not files:
        raise DatasetError(f"{paths[0]} holds no data files (.parquet, .jsonl, .csv, .json)")
    if fmt != "auto":
        return fmt, [f for f in files if _file_format(store, f) in (fmt, None)] or files
    kinds = {f: _file_format(store, f) for f in files}
    unknown = [f for f, k in kinds.items() if k is None]
    if unknown:
        raise DatasetError(
            f"cannot tell the format of {unknown[0]} from its name; "
            "set dataset.format=parquet|jsonl|csv|hf"
        )
    found_kinds = sorted(set(kinds.values()))  # type: ignore[type-var]
    if len(found_kinds) > 1:
        raise DatasetError(
            f"{paths[0]} mixes formats {found_kinds}; point dataset.path at one kind "
            "(e.g. a glob like data/*.parquet) or set dataset.format"
        )
    kind = found_kinds[0]
    return ("hf", _local_only(store, "hf", files)) if kind == "json-array" else (kind, files)


def _local_only(store: Store, fmt: str, files: list[str]) -> list[str]:
    if is_local(store):
        return files
    raise DatasetError(
        f"{files[0]} is read as an HF dataset (format {fmt}: a saved dataset, a loading "
        f"script's folder or one JSON array), which works from local disk only; from object "
        f"storage give {URL_FORMATS}, or copy it to local disk"
    )


def peek_columns(
    fmt: str,
    files: Sequence[str],
    split: str,
    max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    store: Store | None = None,
) -> tuple[list[str], int | None]:
    """Column names (those every file has) and the row count where it is free to know. Not
    for JSON lines, which have no header: `jsonl_scan.scan_json_lines` reads their columns."""
    if fmt in JSON_LINES:
        raise ValueError("the columns of JSON lines come from jsonl_scan.scan_json_lines")
    store = store_of(files[0], store)
    try:
        if fmt == "parquet":
            names, rows = [], 0
            for f in files:  # one file open at a time
                with open_parquet(store, f) as parquet:
                    names.append(parquet.schema_arrow.names)
                    rows += parquet.metadata.num_rows
            return _common_names(files, names), rows
        if fmt == "csv":
            headers = [csv_header(store, f, max_row_bytes) for f in files]
            return _common_names(files, headers), None
        if fmt == "hf":
            ds = _load_hf(files, split)
            return list(ds.column_names), len(ds)
    except DatasetError:
        raise
    except (FileNotFoundError, PermissionError):  # validate names the path and the fix
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DatasetError(f"cannot read {files[0]} as {fmt}: {e}") from e
    raise DatasetError(f"unknown dataset format {fmt!r}")


def _common_names(files: Sequence[str], names: list[list[str]]) -> list[str]:
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


def file_schema(
    fmt: str,
    files: Sequence[str],
    split: str,
    names: Sequence[str],
    store: Store | None = None,
) -> pa.Schema | None:
    """The Arrow types of the named columns as a typed input stores them (Parquet: unified over
    its files; HF datasets: its features); None for JSON lines and CSV, which store none."""
    if fmt not in ("parquet", "hf"):
        return None
    store = store_of(files[0], store)
    try:
        if fmt == "hf":
            found = _load_hf(files, split).features.arrow_schema
            return pa.schema([found.field(n) for n in names])
        schemas = []
        for f in files:
            with open_parquet(store, f) as parquet:
                schemas.append(parquet.schema_arrow)
        return pa.unify_schemas(
            [pa.schema([s.field(n) for n in names]) for s in schemas],
            promote_options="permissive",
        )
    except (FileNotFoundError, PermissionError):  # validate names the path and the fix
        raise
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(
            f"the columns to carry into the output ({', '.join(names)}) have incompatible types "
            f"across the files of {store.parent(files[0])} ({e}); point dataset.path at files "
            "of one schema, or choose the columns with dataset.keep_columns=[...]"
        ) from e


def is_openai_batch(
    path: str, max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES, store: Store | None = None
) -> bool:
    """Whether the first JSON object of a JSON-lines file is an OpenAI Batch request line."""
    for _, line in jsonl_lines(path, max_row_bytes, store):
        try:
            obj = json.loads(line) if isinstance(line, str) else None
        except (json.JSONDecodeError, RecursionError):  # that line's error when it is read
            continue
        if isinstance(obj, dict):
            return "custom_id" in obj and "body" in obj
    return False


def open_records(
    fmt: str,
    files: Sequence[str],
    split: str,
    columns: list[str],
    window_rows: int,
    max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    store: Store | None = None,
) -> Iterator[dict[str, Any] | str]:
    """Stream records of the given columns in input order, one window of rows in memory, one
    file open at a time. A JSONL line longer than max_row_bytes comes out as its error without
    being held in memory; a CSV record longer than it may fail the file (Arrow's reader cannot
    skip one), naming its line."""
    if not files:
        return
    store = store_of(files[0], store)
    if fmt == "parquet":
        for f in files:
            with open_parquet(store, f) as parquet:
                for batch in parquet.iter_batches(batch_size=window_rows, columns=columns):
                    yield from records_of(batch)
    elif fmt in JSON_LINES:
        for f in files:
            yield from _jsonl_records(f, max_row_bytes, store)
    elif fmt == "csv":
        for f in files:
            for batch in csv_batches(store, f, columns, max_row_bytes):
                yield from records_of(batch, text_from_bytes=True)
    elif fmt == "hf":
        ds = _load_hf(files, split).select_columns(columns)
        # Arrow tables straight off the memory-mapped cache: no pandas, one window at a time.
        for batch in ds.with_format("arrow").iter(batch_size=window_rows):
            yield from records_of(batch)
    else:
        raise DatasetError(f"unknown dataset format {fmt!r}")


# --- helpers -----------------------------------------------------------------------------------


def _file_format(store: Store, path: str) -> str | None:
    name = store.name(path).lower()
    for ext in sorted(_EXTENSIONS, key=len, reverse=True):  # .jsonl.gz before .gz-less forms
        if name.endswith(ext):
            kind = _EXTENSIONS[ext]
            return _json_kind(store, path) if kind == "json" else kind
    return None


def _json_kind(store: Store, path: str) -> str:
    with open_binary(store, path) as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip()
    return "json-array" if head.startswith("[") else "jsonl"


def _is_saved_hf(store: Store, folder: str) -> bool:
    return any(store.exists(store.join(folder, m)) for m in _HF_MARKERS)


def jsonl_lines(
    path: str, max_bytes: int, store: Store | None = None
) -> Iterator[tuple[int, str | int | None]]:
    """(line number, text) of each non-blank line; text is None for a line that is not UTF-8,
    and the line's length for one longer than max_bytes (never held in memory whole)."""
    with open_binary(store_of(path, store), path) as fp:
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


def _jsonl_records(path: str, max_bytes: int, store: Store) -> Iterator[dict[str, Any] | str]:
    name = store.name(path)
    for lineno, line in jsonl_lines(path, max_bytes, store):
        if line is None:
            yield f"{name} line {lineno} is not valid UTF-8: fix or re-encode that line"
            continue
        if isinstance(line, int):
            yield (
                f"{name} line {lineno} is {line:,} bytes, over dataset.max_prompt_bytes="
                f"{max_bytes}: shorten that row, or raise the bound"
            )
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{name} line {lineno} is not valid JSON ({e.msg})"
            continue
        except RecursionError:  # json.loads recurses once per level
            yield (
                f"{name} line {lineno} nests objects and arrays deeper than JSON is read "
                f"here (about {sys.getrecursionlimit()} levels): flatten that row"
            )
            continue
        yield obj if isinstance(obj, dict) else f"{name} line {lineno} is not an object"


def count_records(
    fmt: str,
    files: Sequence[str],
    limit: int | None = None,
    max_row_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    store: Store | None = None,
) -> int:
    """Rows of a JSONL or CSV input (at most `limit`), by one streaming pass that parses no
    JSON value: what the progress bar's total needs. JSONL counts non-blank lines; CSV counts
    the rows its parser finds."""
    if fmt not in (*JSON_LINES, "csv"):
        raise ValueError(f"count_records counts jsonl and csv, not {fmt}")
    store = store_of(files[0], store)
    total = 0
    for f in files:
        if fmt in JSON_LINES:
            with open_binary(store, f) as fp:
                for raw in bounded_lines(fp, max_row_bytes):
                    total += isinstance(raw, int) or bool(raw.strip())
                    if limit is not None and total >= limit:
                        return limit
            continue
        for batch in csv_batches(store, f, [], max_row_bytes):
            total += batch.num_rows
            if limit is not None and total >= limit:
                return limit
    return total


def _load_hf(files: Sequence[str], split: str) -> Any:
    """An HF dataset from local disk (resolve_format refuses one at a URL)."""
    import datasets  # imported here: it is slow to import and only this format needs it

    first = str(files[0])
    try:
        if len(files) == 1 and os.path.isdir(first) and _is_saved_hf(store_of(first), first):
            ds = datasets.load_from_disk(first)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DatasetError(
                        f"split {split!r} not in {first}; its splits are: {', '.join(ds)}. "
                        "Set dataset.split=..."
                    )
                ds = ds[split]
            return ds
        if len(files) == 1 and os.path.isdir(first):
            return datasets.load_dataset(first, split=split)
        kind = _file_format(store_of(first), first)
        builder = _HF_BUILDERS.get("jsonl" if kind == "json-array" else kind or "", "json")
        kwargs = {"sep": "\t"} if ".tsv" in Path(first).name.lower() else {}
        return datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split=split, **kwargs
        )
    except DatasetError:
        raise
    except ValueError as e:
        # e.g. an unknown split: HF's message lists the splits that exist.
        raise DatasetError(f"cannot load {first} with HF datasets (split={split!r}): {e}") from e
