"""Reading prompts: Parquet (file, folder, glob), JSONL, CSV, HF datasets and bundled presets.

Two entry points. `validate(spec)` reads schemas and headers, and streams through inputs that
have neither (JSON lines: their columns, types and rows; CSV: its rows) in bounded memory; it
raises `DatasetError` for everything that would make the whole job fail, before the model loads.
`iter_windows(spec)` streams `Row`s in windows of `window_rows`, never holding the whole
dataset. A problem with one row (null, empty or non-text prompt, malformed messages, a bad
override value, an unparsable JSONL line) does not raise: the row is yielded with `error` set, so
that it still gets its output row.

Every file is read through the job's `Store` (batchpage.storage), so dataset.path may be a URL
(s3://bucket/prompts/, gs://bucket/data/*.parquet) as well as a local path: objects are streamed
as files are, and fingerprinted by the store's version (ETag, generation) and size. HF datasets
are read from local disk only.

Row indices are global positions in the input (files of a folder/glob in sorted order). Resume is
keyed on them, so `DatasetInfo.fingerprint` holds what decides them and their results (files,
column choices, prompt settings, the size bound) and deliberately not `limit`: raising the limit
and rerunning resumes the same job.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

import batchpage.data.presets as presets
from batchpage.data.carry import carried_columns, carried_schema, check_window
from batchpage.data.dataset_path import resolve_path
from batchpage.data.image_sources import check_image_options, image_fingerprint
from batchpage.data.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS
from batchpage.data.input_files import storage_error
from batchpage.data.jsonl_scan import scan_json_lines
from batchpage.data.openai_batch import ID_FIELD, REQUEST_FIELDS, make_batch_row
from batchpage.data.readers import (
    DEFAULT_MAX_PROMPT_BYTES,
    JSON_LINES,
    DatasetError,
    count_records,
    is_openai_batch,
    open_records,
    peek_columns,
    resolve_format,
)
from batchpage.data.row_ids import IdTally
from batchpage.data.rows import DEFAULT_OVERRIDES, OVERRIDE_FIELDS, Row, make_row
from batchpage.storage import StorageError, Store, Stores, is_url

FORMATS = ("auto", "parquet", "jsonl", "csv", "hf", "openai_batch")
CHAT_TEMPLATE_MODES = ("auto", "true", "false")
STYLES = ("auto", "instruct", "completion")
# Without dataset.id_column, a column of this name is the row id (as users of other tools expect).
ID_COLUMN = "id"

_log = logging.getLogger(__name__)


@dataclass
class DatasetSpec:
    """Where the prompts are and how to read them (the `dataset` config group).

    path: a file, a folder, a glob (local or a URL: s3://bucket/prefix/, gs://b/x/*.jsonl), or a
    bundled name (`batchpage.data.presets.known_presets()`).
    prompt_column / messages_column: plain text, or a chat (a list of {role, content}). Setting
    messages_column switches to chat unless prompt_column was also changed from its default.
    override_columns: per-row SamplingParams columns; None means max_tokens and temperature
    where the data has them. Listed columns must exist.
    chat_template: auto (chats and prompts with a system_prompt go through the model's chat
    template, plain prompts are sent as raw text), true (plain prompts too, as a user turn) or
    false (plain prompts never; a system_prompt then has nowhere to go and is refused).
    chat_template_kwargs: variables of the chat template (vLLM's chat_template_kwargs), e.g.
    {enable_thinking: false}.
    style: for code-completion prompt sets (the `evals` preset): instruct (a chat turn asking
    for the function, code taken from the reply), completion (raw prompt, stop strings) or
    auto (instruct when the model has a chat template).
    keep_columns: the input columns copied into completions.parquet after batchpage's own;
    None: every column the job does not consume (prompt or messages, id, overrides); []: none.
    format=openai_batch (auto-detected when the first record has custom_id and body): each line
    is an OpenAI Batch request; its body holds the prompt and sampling values, custom_id the id.
    response_column: a reply to score after each prompt (a pooling job: a reward model over a
    generated file's completion column). A chat gets it as its last, assistant turn, rendered
    without a generation prompt; a plain prompt is followed by it as text. A score job
    (engine.task=score) pairs it with the prompt instead: LLM.score(prompt, response).
    max_prompt_bytes: the most UTF-8 bytes of one prompt (a chat's contents together) and of
    the text the chat template makes of it, and of one input row as stored (a JSONL line, a CSV
    record). A longer JSONL line or prompt is that row's error, found before it is tokenized
    and without holding the line in memory; a longer CSV record may fail the file (Arrow's
    reader cannot skip it), at once and naming its line. It changes which rows fail, so a
    value other than the default is part of the fingerprint.
    image_column: each row's images for a vision-language model, one or a list: encoded bytes,
    a {bytes, path} image struct (HF datasets, Parquet), a path (relative: beside the row's
    data file; not read yet for data in object storage), a file:/data: URL, or an http(s) URL
    with allow_image_http. Chats' image parts (a messages column, OpenAI Batch bodies) are
    their rows' images without it. max_image_pixels / max_image_bytes bound each image before
    it is decoded, image_http_timeout_s each download; a bad image is its row's error.
    """

    path: str = "evals"
    format: str = "auto"
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    response_column: str | None = None
    system_prompt: str | None = None
    id_column: str | None = None
    split: str = "train"
    limit: int | None = None
    override_columns: list[str] | None = None
    window_rows: int = 1024
    chat_template: str = "auto"
    # A mapping (or None). Typed Any because Hydra cannot set `dataset.chat_template_kwargs={...}`
    # on an empty typed-dict node in struct mode.
    chat_template_kwargs: Any = None
    style: str = "auto"
    keep_columns: list[str] | None = None
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    # Each row's LoRA adapter: a name of model.loras or an adapter folder; null or empty: the
    # base model. Needs engine.enable_lora=true.
    lora_column: str | None = None
    image_column: str | None = None
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_image_bytes: int = DEFAULT_MAX_BYTES
    allow_image_http: bool = False
    image_http_timeout_s: float = 30.0


@dataclass(frozen=True)
class DatasetInfo:
    """What `validate` found: the resolved reading plan and facts the job can report early."""

    format: str  # resolved: parquet | jsonl | csv | hf | openai_batch
    files: tuple[str, ...]  # what is read, in order (an HF folder is one entry)
    columns: tuple[str, ...]
    prompt_column: str | None  # exactly one of these two is set (neither for openai_batch)
    messages_column: str | None
    id_column: str | None
    override_columns: tuple[str, ...]
    num_rows: int | None  # after limit
    # What decides the rows (file digests, format, column choices, system prompt) as plain
    # JSON-able data, so that a refused resume can name the setting that changed.
    fingerprint: dict[str, Any]
    preset: str | None = None
    styles: presets.PromptStyles | None = None  # the ways its prompts can be posed, if any
    chat_template: str = "auto"  # normalised: auto | true | false
    carried: tuple[str, ...] = ()  # input columns copied to the output, in order
    carried_schema: pa.Schema = field(default_factory=lambda: pa.schema([]))
    response_column: str | None = None
    lora_column: str | None = None
    image_column: str | None = None


# --- validate ----------------------------------------------------------------------------------


def validate(spec: DatasetSpec, stores: Stores | None = None) -> DatasetInfo:
    """Resolve and check the spec; raise DatasetError on a fatal issue (a missing bucket or
    object, or access denied, is one too, naming the URL and the fix). A JSON-lines input is
    read through once whatever the limit (its columns and types are the output's schema,
    which raising the limit must not change), streamed; see `jsonl_scan`. `stores`: the job's
    (None: default storage settings)."""
    try:
        return _validate(spec, stores or Stores())
    except (StorageError, FileNotFoundError, PermissionError) as e:
        raise storage_error(spec.path, e) from None


def _validate(spec: DatasetSpec, stores: Stores) -> DatasetInfo:
    if spec.format not in FORMATS:
        raise DatasetError(f"dataset.format={spec.format!r} is unknown; use one of {FORMATS}")
    if spec.limit is not None and spec.limit < 0:
        raise DatasetError(f"dataset.limit={spec.limit} must be >= 0 (or null for all rows)")
    if spec.window_rows < 1:
        raise DatasetError(f"dataset.window_rows={spec.window_rows} must be >= 1")
    if spec.max_prompt_bytes < 1:
        raise DatasetError(
            f"dataset.max_prompt_bytes={spec.max_prompt_bytes} must be >= 1 (default "
            f"{DEFAULT_MAX_PROMPT_BYTES})"
        )
    check_image_options(spec)
    bound = spec.max_prompt_bytes
    chat_template = str(spec.chat_template).lower()
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise DatasetError(
            f"dataset.chat_template={spec.chat_template!r} is unknown; use auto, true or false"
        )
    if chat_template == "false" and spec.system_prompt:
        raise DatasetError(
            "dataset.system_prompt needs the chat template, and dataset.chat_template=false: "
            "drop one of the two"
        )
    if spec.style not in STYLES:
        raise DatasetError(f"dataset.style={spec.style!r} is unknown; use one of {STYLES}")
    kwargs = spec.chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise DatasetError(
            f"dataset.chat_template_kwargs must map template variables to values, e.g. "
            f"{{enable_thinking: false}}; got {kwargs!r:.60}"
        )
    paths, preset, store = resolve_path(spec.path, stores)
    if spec.style != "auto" and not (preset and preset.styles):
        raise DatasetError(
            f"dataset.style={spec.style} applies to code-completion prompt sets (the evals "
            "preset); for other data use dataset.chat_template=true|false"
        )
    fmt, files = resolve_format(spec.format, paths, store)
    if fmt == "jsonl" and spec.format == "auto" and is_openai_batch(files[0], bound, store):
        fmt = "openai_batch"
    # JSON lines have no header: one pass finds their columns, types and rows together.
    # Its candidate id columns are tallied in the same pass (which one is the id is known after).
    candidates = [c for c in (spec.id_column, ID_COLUMN, ID_FIELD) if c is not None]
    scan = (
        scan_json_lines(files, bound, store, candidates, spec.limit) if fmt in JSON_LINES else None
    )
    if scan is not None:
        columns, num_rows = list(scan.columns), scan.records
    else:
        columns, num_rows = peek_columns(fmt, files, spec.split, bound, store)
    if fmt == "openai_batch":
        prompt_col, messages_col, id_column, overrides = _batch_columns(spec, columns, files)
    else:
        id_column = spec.id_column
        if id_column is None and preset is not None:
            id_column = preset.id_column
        elif id_column is None and ID_COLUMN in columns:
            id_column = ID_COLUMN
            _log.info("dataset: column %r is the row id (dataset.id_column chooses)", ID_COLUMN)
        prompt_col, messages_col = _text_columns(spec)
        overrides = _override_columns(spec, columns)
        for col in (prompt_col, messages_col, id_column, spec.response_column, spec.lora_column,
                    spec.image_column, *overrides):  # fmt: skip
            if col is not None and col not in columns:
                raise DatasetError(_missing_column_message(col, columns, spec, files))
    tally = scan.ids.get(id_column) if scan is not None and id_column is not None else None
    if id_column is not None and (spec.id_column is not None or fmt == "openai_batch"):
        _check_ids(fmt, files, spec, id_column, store, tally=tally)
    elif id_column == ID_COLUMN and preset is None:
        _check_ids(fmt, files, spec, id_column, store, auto=True, tally=tally)
    batch = fmt == "openai_batch"
    if batch and spec.response_column is not None:
        raise DatasetError(
            "an OpenAI Batch file has no response column: drop dataset.response_column"
        )
    if batch and spec.lora_column is not None:
        raise DatasetError(
            "an OpenAI Batch file has no adapter column: drop dataset.lora_column (its "
            "requests' model field is not read as an adapter yet)"
        )
    if batch and spec.image_column is not None:
        raise DatasetError(
            "an OpenAI Batch file has no image column: drop dataset.image_column (its chat "
            "bodies' image_url parts are their requests' images)"
        )
    response = spec.response_column
    own = (prompt_col, messages_col, id_column, response, spec.lora_column, spec.image_column)
    consumed = REQUEST_FIELDS if batch else (*own, *overrides)
    carried = carried_columns(columns, consumed, spec.keep_columns, files[0])

    if num_rows is None and fmt == "csv":
        num_rows = count_records(fmt, files, spec.limit, bound, store)
    if num_rows is not None and spec.limit is not None:
        num_rows = min(num_rows, spec.limit)
    key = {
        # By path, so that a refused resume names the file that changed. A local file's entry
        # hashes its bytes; an object's is its store's version (ETag, generation) and size.
        "files": {f: store.digest(f) for f in files},
        "format": fmt,
        "split": spec.split if fmt == "hf" else None,
        "columns": [prompt_col, messages_col, id_column, list(overrides)],
        "system_prompt": spec.system_prompt,
        "chat_template": chat_template,
        "chat_template_kwargs": dict(kwargs) if kwargs else None,
        "carried": list(carried),
    }
    if response is not None:  # only then: other jobs keep their key
        key["response_column"] = response
    if spec.lora_column is not None:  # only then: other jobs keep their key
        key["lora_column"] = spec.lora_column
    if spec.max_prompt_bytes != DEFAULT_MAX_PROMPT_BYTES:  # only then: other jobs keep their key
        key["max_prompt_bytes"] = spec.max_prompt_bytes
    key.update(image_fingerprint(spec))
    return DatasetInfo(
        format=fmt,
        files=tuple(files),
        columns=tuple(columns),
        prompt_column=prompt_col,
        messages_column=messages_col,
        id_column=id_column,
        override_columns=overrides,
        num_rows=num_rows,
        fingerprint=key,
        preset=preset.name if preset else None,
        styles=preset.styles if preset else None,
        chat_template=chat_template,
        response_column=response,
        lora_column=spec.lora_column,
        image_column=spec.image_column,
        carried=carried,
        carried_schema=carried_schema(
            fmt, files, spec.split, carried, scan.columns if scan else None, store
        ),
    )


def _override_columns(spec: DatasetSpec, columns: list[str]) -> tuple[str, ...]:
    if spec.override_columns is None:
        return tuple(c for c in DEFAULT_OVERRIDES if c in columns)
    unknown = [c for c in spec.override_columns if c not in OVERRIDE_FIELDS]
    if unknown:
        raise DatasetError(
            f"dataset.override_columns has {unknown}, which are not per-row sampling "
            f"parameters; allowed: {', '.join(OVERRIDE_FIELDS)}"
        )
    return tuple(spec.override_columns)


def _batch_columns(
    spec: DatasetSpec, columns: list[str], files: Sequence[str]
) -> tuple[None, None, str, tuple[str, ...]]:
    """An OpenAI Batch file's lines carry their prompt, id and sampling values: settings that
    would pick them from columns are refused rather than ignored."""
    if ID_FIELD not in columns or "body" not in columns:
        raise DatasetError(
            f"{files[0]} is not an OpenAI Batch file: its first lines have no custom_id and "
            "body; drop dataset.format=openai_batch to read it as plain JSON lines"
        )
    set_here = [
        name
        for name, value, default in (
            ("prompt_column", spec.prompt_column, DatasetSpec.prompt_column),
            ("messages_column", spec.messages_column, None),
            ("id_column", spec.id_column, None),
            ("override_columns", spec.override_columns, None),
            ("system_prompt", spec.system_prompt, None),
        )
        if value != default
    ]
    if set_here:
        raise DatasetError(
            "an OpenAI Batch file takes the prompt, id and sampling values from each request "
            f"line; drop dataset.{', dataset.'.join(set_here)}"
        )
    return None, None, ID_FIELD, ()


def _text_columns(spec: DatasetSpec) -> tuple[str | None, str | None]:
    default_prompt = DatasetSpec.prompt_column
    if spec.messages_column:
        if spec.prompt_column and spec.prompt_column != default_prompt:
            raise DatasetError(
                f"both dataset.prompt_column={spec.prompt_column!r} and dataset.messages_column="
                f"{spec.messages_column!r} are set; keep one (set the other to null)"
            )
        return None, spec.messages_column
    if not spec.prompt_column:
        raise DatasetError(
            "neither dataset.prompt_column nor dataset.messages_column is set; set one "
            "(e.g. dataset.prompt_column=question or dataset.messages_column=messages)"
        )
    return spec.prompt_column, None


def _missing_column_message(col: str, columns: list[str], spec: DatasetSpec, files: list) -> str:
    msg = f"column {col!r} not found in {files[0]}; its columns are: {', '.join(columns)}."
    chatty = [c for c in columns if c in ("messages", "conversations", "chat")]
    if col == spec.prompt_column and chatty:
        msg += f" For chats set dataset.messages_column={chatty[0]}."
    elif col == spec.image_column:
        msg += " Name the column of each row's images with dataset.image_column=..."
    else:
        msg += " Pick one with dataset.prompt_column=/messages_column=/id_column=..."
    return msg


def _check_ids(
    fmt: str,
    files: Sequence[str],
    spec: DatasetSpec,
    column: str,
    store: Store,
    auto: bool = False,
    tally: IdTally | None = None,
) -> None:
    """Ids key the output rows: refuse duplicates, and nulls (which would fall back to the row
    index and could collide with a real id), naming the first few. One pass over the column. A
    line the reader could not parse (not UTF-8, not JSON, too long) has no id to check: it is
    that row's error, with a null id (rows.make_row).
    `auto`: the column is the row id by its name, not because dataset.id_column names it.
    `tally`: the column's values, already taken by a pass over the input (JSON lines' scan)."""
    if tally is None:  # JSON lines were tallied by their scan; other formats read the column
        tally = IdTally(spec.limit)
        records = open_records(
            fmt, files, spec.split, [column], spec.window_rows, spec.max_prompt_bytes, store
        )
        for index, rec in enumerate(records):
            if spec.limit is not None and index >= spec.limit:
                break
            if not isinstance(rec, str):
                tally.add(index, rec.get(column))
    what = f"dataset.id_column={column!r}"
    fix = "drop id_column to use the row index"
    if auto:
        what = f"column {column!r} (the row id: dataset.id_column is not set)"
        fix = "or set dataset.id_column to a column of unique ids"
    # A line without custom_id is that line's error.
    tally.check(what, fix, nulls_allowed=fmt == "openai_batch")


# --- iterate -----------------------------------------------------------------------------------


def iter_rows(
    spec: DatasetSpec, info: DatasetInfo | None = None, stores: Stores | None = None
) -> Iterator[Row]:
    """Every row in input order (up to spec.limit), each checked; see `iter_windows`. `info`:
    what validate(spec) returned, when the caller has it (validating reads every byte).
    `stores`: the job's (None: default storage settings)."""
    stores = stores or Stores()
    info = info or validate(spec, stores)
    if spec.limit == 0:
        return
    from_text = info.format == "csv"  # CSV cells are all text: numbers there are parsed
    columns = [
        info.prompt_column or info.messages_column,
        info.id_column,
        info.response_column,
        info.lora_column,
        info.image_column,
        *info.override_columns,
        *info.carried,
    ]
    wanted = list(dict.fromkeys(c for c in columns if c))  # unique, in order
    bound = spec.max_prompt_bytes
    store = stores.store_for(info.files[0])
    for index, (folder, rec) in enumerate(_records(spec, info, wanted, store)):
        if info.format == "openai_batch":
            row = make_batch_row(index, rec, info.carried, bound)
        else:
            row = make_row(
                index,
                rec,
                prompt_column=info.prompt_column,
                messages_column=info.messages_column,
                id_column=info.id_column,
                override_columns=info.override_columns,
                system_prompt=spec.system_prompt,
                from_text=from_text,
                carried=info.carried,
                max_prompt_bytes=bound,
                response_column=info.response_column,
                lora_column=info.lora_column,
                image_column=info.image_column,
            )
        if row.images:
            row.image_folder = folder
        yield row
        if spec.limit is not None and index + 1 >= spec.limit:
            return


def _records(
    spec: DatasetSpec, info: DatasetInfo, columns: list[str], store: Store
) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """The records of `columns` in input order, each with the folder (or object-storage prefix)
    of its data file: where its relative image paths are read. An HF dataset is read as one
    (a saved folder, or files loaded together): its folder is its first entry's."""
    groups = [info.files] if info.format == "hf" else [[f] for f in info.files]
    for files in groups:
        first = files[0]
        if is_url(first):
            folder = first.rsplit("/", 1)[0]
        else:
            folder = first if os.path.isdir(first) else str(Path(first).parent)
        records = open_records(
            info.format, files, spec.split, columns, spec.window_rows, spec.max_prompt_bytes, store
        )
        for rec in records:
            yield folder, rec


def iter_windows(
    spec: DatasetSpec, info: DatasetInfo | None = None, stores: Stores | None = None
) -> Iterator[list[Row]]:
    """Rows in windows of spec.window_rows (the last may be shorter), streamed: a file or object
    is fetched as its rows are read. Carried values of JSON lines, whose types were inferred
    from each column's first records, are checked per window. `info`: what validate(spec)
    found, if the caller has it (it reads JSON lines whole). `stores`: the job's."""
    stores = stores or Stores()
    info = info or validate(spec, stores)
    inferred = info.format in JSON_LINES and len(info.carried_schema) > 0
    window: list[Row] = []
    for row in iter_rows(spec, info, stores):
        window.append(row)
        if len(window) >= spec.window_rows:
            if inferred:
                check_window(window, info.carried_schema)
            yield window
            window = []
    if window:
        if inferred:
            check_window(window, info.carried_schema)
        yield window
