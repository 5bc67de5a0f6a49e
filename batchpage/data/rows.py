"""One input record -> one checked `Row`: the row-level half of `batchpage.data.spec`.

Nothing here raises for bad data: a null, empty or non-text prompt or a malformed chat becomes
the row's `error`, and the job goes on without it. Per-row overrides are carried as found; a bad
one becomes the row's error when the job builds its SamplingParams. A `response_format` column
(OpenAI's shape) is read here into the row's `structured_outputs` override, so a malformed one is
the row's error at once; a schema that does not compile is the row's error when it runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from batchpage.chat_messages import normalize_messages
from batchpage.data.image_sources import column_images
from batchpage.data.readers import DEFAULT_MAX_PROMPT_BYTES
from batchpage.data.text_checks import escaped, size_error, text_error, utf8_size
from batchpage.sampling_params import StructuredOutputsParams

# Override columns picked up wherever the data has them (dataset.override_columns=null).
DEFAULT_OVERRIDES = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "thinking_token_budget",
    "response_format",
)


# Per-row SamplingParams overrides, with the type their text is parsed as in a CSV. Only types
# are settled here; SamplingParams checks every range, against the job's own values (a row's
# min_tokens is checked against the job's max_tokens). An `n` column makes completion and
# finish_reason lists in every output row (the job plans that from the columns).
OVERRIDE_FIELDS: MappingProxyType[str, type] = MappingProxyType(
    {
        "n": int,
        "max_tokens": int,
        "min_tokens": int,
        "temperature": float,
        "top_p": float,
        "top_k": int,
        "min_p": float,
        "seed": int,
        "presence_penalty": float,
        "frequency_penalty": float,
        "repetition_penalty": float,
        "ignore_eos": bool,
        "stop": list,
        "thinking_token_budget": int,
        "response_format": StructuredOutputsParams,  # OpenAI's shape, as a struct or JSON text
    }
)
# Override columns named otherwise than the SamplingParams field they set.
_FIELD_OF_COLUMN = {"response_format": "structured_outputs"}


# A lora column names an adapter or a folder: a path's worth of bytes at most.
MAX_ADAPTER_NAME_BYTES = 4096


@dataclass
class Row:
    """One input row. `error` set means: do not generate, write the row with this error."""

    index: int  # global position in the input; resume is keyed on it
    # The id column's value as text, or str(index); None: a batch line without one, or an
    # unreadable line of an input with an id column.
    id: str | None
    prompt: str | None = None
    # system_prompt already prepended; a turn with images has a list of text and
    # {"type": "image"} parts as its content (chat_messages.normalize_messages)
    messages: list[dict[str, Any]] | None = None
    system_prompt: str | None = None  # set for plain prompts only (chats carry it inside)
    response: str | None = None  # dataset.response_column's reply to score after the prompt
    # An /v1/embeddings line's inputs when they are not one text: several texts, or token ids
    # (one list, or a list of lists); each is embedded, and the row's answer holds them all.
    inputs: list[str | list[int]] | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # non-null per-row sampling values
    lora: str | None = None  # dataset.lora_column's adapter (a model.loras name or a folder)
    # Its images' sources as given, in prompt order (the image column's, or its chat's image
    # parts'), not decoded; None: none. Relative paths are read from image_folder: the folder
    # (or object-storage prefix) of the data file the row came from.
    images: list[Any] | None = None
    image_folder: str | None = None
    error: str | None = None
    # Values of the output's extra columns that come from the input: the carried columns (and an
    # OpenAI Batch line's url), by column name.
    extra: dict[str, Any] = field(default_factory=dict)

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """The row as a chat: its messages, or [system?, user prompt]; None for an error row."""
        if self.error is not None:
            return None
        if self.messages is not None:
            return self.messages
        sys_msg = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*sys_msg, {"role": "user", "content": self.prompt or ""}]


_MISSING = object()


def make_row(
    index: int,
    rec: dict[str, Any] | str,
    *,
    prompt_column: str | None,
    messages_column: str | None,
    id_column: str | None,
    override_columns: Sequence[str],
    system_prompt: str | None,
    from_text: bool,
    carried: Sequence[str] = (),
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    response_column: str | None = None,
    lora_column: str | None = None,
    image_column: str | None = None,
) -> Row:
    """Check one record. `rec` is a str when the reader could not parse it (it says why).

    from_text: the values are all text (CSV), so numbers in override columns are parsed.
    carried: the input columns copied to the output row as they are.
    max_prompt_bytes: a longer prompt (a chat: its text together) is the row's error.
    image_column: the row's images (one or a list); a chat's image parts are its images too,
    and a row with both is its error.
    """
    if isinstance(rec, str):
        # The line's id is unknown: null, rather than the row index, which may be another
        # row's id. Without an id column every row's id is its index.
        return Row(index=index, id=None if id_column else str(index), error=rec)
    text_column = messages_column if messages_column is not None else prompt_column or ""
    errors, bad = _unencodable_columns(
        index,
        rec,
        [text_column, id_column, response_column, lora_column, image_column, *override_columns,
         *carried],
    )  # fmt: skip
    if bad:  # a value no UTF-8 writer takes goes nowhere: the row holds a null instead
        rec = {k: (None if k in bad else v) for k, v in rec.items()}
    row = Row(index=index, id=_row_id(rec, id_column, index))
    if id_column in bad:
        row.id = escaped(bad[id_column])
    row.extra = {name: rec.get(name) for name in carried}
    err = None
    images: list[Any] = []
    if text_column in bad:
        pass  # its error is in errors already
    elif messages_column is not None:
        value = rec.get(messages_column, _MISSING)
        row.messages, err = _check_messages(value, system_prompt, images)
        err = err or messages_size_error(row.messages, max_prompt_bytes)
        row.messages = None if err else row.messages
    else:
        row.prompt, err = _check_prompt(rec.get(prompt_column or "", _MISSING))
        err = err or prompt_size_error(row.prompt, max_prompt_bytes)
        row.prompt = None if err else row.prompt
        row.system_prompt = system_prompt
    if err:
        errors.append(err)
    if response_column is not None and response_column not in bad:
        row.response, err = _check_text(rec.get(response_column, _MISSING), "response")
        err = err or size_error_of(row.response, max_prompt_bytes, "the response")
        row.response = None if err else row.response
        if err:
            errors.append(err)
    if lora_column is not None and lora_column not in bad:
        row.lora, err = _check_adapter(rec.get(lora_column))
        if err:
            errors.append(err)
    if image_column is not None and image_column not in bad:
        column, err = column_images(rec.get(image_column))
        if column and images:
            err = (
                "the row has images both in its image column and in its chat's image parts: "
                'give them in one place (a chat may hold bare {"type": "image"} parts where '
                "the column's images go)"
            )
        images = images or column
        if err:
            errors.append(err)
    row.images = images or None
    for name in override_columns:
        value = rec.get(name)
        blank = from_text and isinstance(value, str) and not value.strip()
        if value is None or blank:
            continue  # no override for this row: the job's sampling applies
        if isinstance(value, float) and math.isnan(value):
            errors.append(f"bad {name}: NaN is not a value; leave it null for the job's setting")
            continue
        field_name = _FIELD_OF_COLUMN.get(name, name)
        try:
            row.overrides[field_name] = coerce_override(name, value, from_text)
        except ValueError as e:
            errors.append(f"bad {name}: {e}")
    row.error = "; ".join(errors) or None
    if row.error is not None:
        row.images = None  # nothing of a failed row is read
    return row


def _check_adapter(value: Any) -> tuple[str | None, str | None]:
    """(the adapter a lora column's value names, None for the base model; an error)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None
    if not isinstance(value, str):
        return None, f"the lora column must be text naming an adapter, got {type(value).__name__}"
    if len(value.encode()) > MAX_ADAPTER_NAME_BYTES:
        return None, f"the lora column's value is over {MAX_ADAPTER_NAME_BYTES} bytes"
    return (value.strip() or None), None


def prompt_size_error(prompt: str | None, bound: int) -> str | None:
    """The error of a prompt over `bound` UTF-8 bytes, else None."""
    return size_error_of(prompt, bound, "the prompt")


def size_error_of(text: str | None, bound: int, what: str) -> str | None:
    """The error of a text over `bound` UTF-8 bytes, else None."""
    size = utf8_size(text, bound) if text is not None else None
    return size_error(what, size, bound) if size is not None else None


def messages_size_error(messages: list[dict[str, Any]] | None, bound: int) -> str | None:
    """The error of a chat whose text together is over `bound` UTF-8 bytes, else None."""
    if not messages:
        return None
    size = utf8_size("".join(map(_content_text, messages)), bound)
    return size_error("the chat's content", size, bound) if size is not None else None


def _content_text(message: dict[str, Any]) -> str:
    """A normalised message's text: its content, or its text parts' (image parts hold none)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content)


def _unencodable_columns(
    index: int, rec: dict[str, Any], columns: Sequence[str | None]
) -> tuple[list[str], dict[str, Any]]:
    """The errors of the used columns whose values cannot be written as UTF-8, and those values
    by column."""
    errors: list[str] = []
    bad: dict[str, Any] = {}
    for name in dict.fromkeys(c for c in columns if c):
        problem = text_error(index, name, rec.get(name))
        if problem is not None:
            errors.append(problem)
            bad[name] = rec.get(name)
    return errors, bad


def coerce_override(name: str, value: Any, from_text: bool = False) -> Any:
    """One per-row override in the form SamplingParams takes: a single stop string becomes a
    list, and CSV text is parsed as the field's type (text that does not parse stays text, and
    SamplingParams names the field when the job builds the row's parameters). A response_format
    becomes StructuredOutputsParams (None for {"type": "text"}: no constraint); a malformed one
    raises ValueError."""
    kind = OVERRIDE_FIELDS[name]
    if kind is StructuredOutputsParams:
        # Arrow gives every row of a struct column the union of all rows' fields, the missing
        # ones as nulls: dropped, so each row's schema is its own (JSON text is taken as is).
        try:
            return StructuredOutputsParams.from_response_format(_drop_nulls(value))
        except RecursionError:  # JSON text is read, and nulls dropped, once per level
            raise ValueError("its schema is nested too deeply to read: flatten it") from None
    if kind is list:
        return (
            [value]
            if isinstance(value, str)
            else list(value)
            if isinstance(value, tuple)
            else value
        )
    if from_text and isinstance(value, str):
        return _parse_text(value.strip(), kind)
    return value


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _parse_text(text: str, kind: type) -> Any:
    try:
        if kind is bool:
            return {"true": True, "false": False, "1": True, "0": False}.get(text.lower(), text)
        return float(text) if kind is float or "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return text  # left as text: the type check reports it


def _row_id(rec: dict[str, Any], id_column: str | None, index: int) -> str:
    value = rec.get(id_column) if id_column else None
    if value is None:
        return str(index)
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _check_prompt(value: Any) -> tuple[str | None, str | None]:
    return _check_text(value, "prompt", blank_ok=False)


def _check_text(value: Any, what: str, blank_ok: bool = True) -> tuple[str | None, str | None]:
    if value is _MISSING:
        return None, f"the row has no {what} field"
    if value is None:
        return None, f"{what} is null"
    if not isinstance(value, str):
        return None, f"{what} is not text (got {type(value).__name__}: {str(value)[:40]!r})"
    if not blank_ok and not value.strip():
        return None, f"{what} is empty"
    return value, None


def _check_messages(
    value: Any, system_prompt: str | None, images: list[Any]
) -> tuple[list | None, str | None]:
    """The chat, or its error; its image parts' sources are appended to `images`."""
    if value is _MISSING:
        return None, "the row has no messages field"
    if isinstance(value, dict) and isinstance(value.get("role"), list):
        # HF `Sequence` features hand a list of structs over as a struct of lists.
        try:
            value = [dict(zip(value, v, strict=True)) for v in zip(*value.values(), strict=True)]
        except ValueError:
            return None, "messages has role and content lists of different lengths"
    if isinstance(value, str):  # CSV (and some JSONL) store the chat as a JSON string
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):  # json.loads recurses once per level
            return None, "messages is text that is not JSON; expected a list of {role, content}"
    try:
        messages = normalize_messages(value, images)
    except ValueError as e:
        images.clear()
        return None, str(e)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages, None
