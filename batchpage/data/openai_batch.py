"""One line of an OpenAI Batch input file -> one checked `Row`.

A line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/embeddings", "body": {...}}``. The body's prompt (``messages`` for chat, whose image_url
parts are the row's images, ``prompt`` for completions, ``input`` for embeddings) and its
sampling fields become the row's prompt and per-row overrides; ``model`` and the bookkeeping
fields OpenAI accepts are ignored (the job's model runs). Anything else in the body, an unknown
url, a missing prompt or a value of the wrong kind is that line's error: it gets its line in
batch_errors.jsonl and the other requests run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchpage.chat_messages import normalize_messages
from batchpage.data.readers import DEFAULT_MAX_PROMPT_BYTES
from batchpage.data.rows import Row, coerce_override, messages_size_error, prompt_size_error
from batchpage.data.text_checks import text_error, unencodable
from batchpage.sampling_params import StructuredOutputsParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # answered by a job with engine.task=embed
# OpenAI's own bound on one embeddings request's inputs.
MAX_EMBEDDING_INPUTS = 2048
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
ID_FIELD = "custom_id"
# The request's own fields: consumed, never carried into the output as input columns.
REQUEST_FIELDS = (ID_FIELD, "method", "url", "body")

# Body fields that map one to one onto SamplingParams (values checked there).
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "thinking_token_budget",  # vLLM's extension, for a job with a reasoning parser
)
# Accepted and ignored: they do not change what is generated.
_IGNORED = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "stream", "stream_options"}
)
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs"})
_BOTH = frozenset({*_SAMPLING_FIELDS, "logprobs", "response_format", *_IGNORED})


def make_batch_row(
    index: int,
    rec: dict[str, Any] | str,
    carried: Sequence[str] = (),
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
) -> Row:
    """Check one request line (`rec` is a str when the reader could not parse it); a prompt
    over max_prompt_bytes (a chat: its contents together) is its error."""
    if isinstance(rec, str):
        return Row(index=index, id=None, error=rec)
    problems = [p for p in (text_error(index, k, v) for k, v in rec.items()) if p is not None]
    if problems:
        # Nothing of such a line is used: its custom_id could not even be written back.
        custom_id = rec.get(ID_FIELD)
        row = Row(index=index, id=None, error="; ".join(problems))
        fine = isinstance(custom_id, str) and text_error(index, ID_FIELD, custom_id) is None
        row.id = custom_id if fine and custom_id else None
        row.extra = {n: None if unencodable(rec.get(n)) else rec.get(n) for n in carried}
        row.extra["url"] = None
        return row
    custom_id = rec.get(ID_FIELD)
    url = rec.get("url")
    row = Row(index=index, id=custom_id if isinstance(custom_id, str) and custom_id else None)
    row.extra = {name: rec.get(name) for name in carried}
    row.extra["url"] = url if isinstance(url, str) else None
    try:
        _check_line(rec, custom_id, url)
        _read_body(row, rec["body"], url)
        # An embeddings line's inputs are bounded by the line's own size (max_prompt_bytes).
        size_problem = prompt_size_error(row.prompt, max_prompt_bytes) or messages_size_error(
            row.messages, max_prompt_bytes
        )
        if size_problem:
            row.prompt = row.messages = None
            raise ValueError(size_problem)
    except ValueError as e:
        row.error = str(e)
        row.images = None  # nothing of a failed line is read
    return row


def _check_line(rec: dict[str, Any], custom_id: Any, url: Any) -> None:
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"custom_id must be a non-empty string, got {custom_id!r:.60}")
    method = rec.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method must be POST, got {method!r:.40}")
    if url not in URLS:
        raise ValueError(f"url {url!r:.60} is not supported; batchpage runs {', '.join(URLS)}")
    if not isinstance(rec.get("body"), dict):
        raise ValueError(f"body must be an object, got {type(rec.get('body')).__name__}")


def _read_body(row: Row, body: dict[str, Any], url: str) -> None:
    if url == EMBEDDINGS_URL:
        _read_embeddings_body(row, body)
        return
    chat = url == CHAT_URL
    allowed = _BOTH | (_CHAT_ONLY if chat else {"prompt"})
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(
            f"body field(s) {', '.join(unknown)} are not supported for {url}; remove them "
            f"(supported: {', '.join(sorted(allowed - _IGNORED))})"
        )
    if chat:
        if "messages" not in body:
            raise ValueError(f"a {CHAT_URL} body needs messages")
        images: list[Any] = []  # its image parts' sources, in order
        row.messages = normalize_messages(body["messages"], images)
        row.images = images or None
    else:
        row.prompt = _prompt(body.get("prompt"))
    overrides = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        if "max_tokens" in overrides:
            raise ValueError("body sets both max_tokens and max_completion_tokens; keep one")
        overrides["max_tokens"] = body["max_completion_tokens"]
    if "stop" in overrides:
        overrides["stop"] = coerce_override("stop", overrides["stop"])
    logprobs = _chat_logprobs(body) if chat else body.get("logprobs")
    if logprobs is not None:
        overrides["logprobs"] = logprobs
    if body.get("response_format") is not None:
        try:
            constraint = StructuredOutputsParams.from_response_format(body["response_format"])
        except ValueError as e:
            raise ValueError(f"bad response_format: {e}") from None
        if constraint is not None:
            overrides["structured_outputs"] = constraint
    row.overrides = overrides


def _read_embeddings_body(row: Row, body: dict[str, Any]) -> None:
    allowed = {"input", "encoding_format", *_IGNORED}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ValueError(
            f"body field(s) {', '.join(unknown)} are not supported for {EMBEDDINGS_URL}; remove "
            "them (supported: input, encoding_format)"
        )
    if body.get("encoding_format", "float") != "float":
        raise ValueError(
            f"encoding_format {body['encoding_format']!r:.30} is not supported: use float"
        )
    inputs = _embedding_inputs(body.get("input"))
    if len(inputs) == 1 and isinstance(inputs[0], str):
        row.prompt = inputs[0]
    else:
        row.inputs = inputs


def _embedding_inputs(value: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a text, an array of texts, an array of token ids, or an array of
    token-id arrays; as a list of texts or token-id lists, each checked."""
    shapes = (
        "input must be a string, an array of strings, an array of token ids or an array of "
        "token-id arrays"
    )
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{shapes}; got {type(value).__name__ if value != [] else 'an empty array'}"
        )
    if all(_is_token(t) for t in value):
        value = [value]  # one input, as token ids
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ValueError(
            f"input has {len(value)} items, at most {MAX_EMBEDDING_INPUTS} a request (as OpenAI "
            "allows): split it over several lines"
        )
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item.strip():
                raise ValueError(f"input[{i}] is empty")
        elif not isinstance(item, list) or not item or not all(_is_token(t) for t in item):
            raise ValueError(f"{shapes}; input[{i}] is neither a text nor token ids")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ValueError(
            f"a {COMPLETIONS_URL} body needs prompt as one string (got {type(value).__name__}); "
            "send one line per prompt"
        )
    if not value.strip():
        raise ValueError("prompt is empty")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's logprobs (a bool) and top_logprobs (0-20) as SamplingParams.logprobs."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ValueError(f"logprobs must be true or false for {CHAT_URL}, got {wanted!r:.40}")
    if top is None:
        return 0 if wanted else None
    if not wanted:
        raise ValueError("top_logprobs needs logprobs: true")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise ValueError(f"top_logprobs must be an integer from 0 to 20, got {top!r:.40}")
    return top
