"""One line of an OpenAI Batch input file -> one checked `Row`.

A line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/embeddings", "body": {...}}``. The body's prompt (``messages`` for chat, ``prompt`` for
completions, ``input`` for embeddings) and its sampling fields become the row's prompt and
per-row overrides; ``model`` and the bookkeeping
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
        size_problem = prompt_size_error(row.prompt, max_prompt_bytes) or messages_size_error(
            row.messages, max_prompt_bytes
        )
        if size_problem:
            row.prompt = row.messages = None
            raise ValueError(size_problem)
    except ValueError as e:
        row.error = str(e)
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
        row.messages = normalize_messages(body["messages"])
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
    row.prompt = _prompt(body.get("input"), EMBEDDINGS_URL, "input")


def _prompt(value: Any, url: str = COMPLETIONS_URL, name: str = "prompt") -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ValueError(
            f"a {url} body needs {name} as one string (got {type(value).__name__}); "
            f"send one line per {name}"
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
