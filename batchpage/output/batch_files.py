"""An OpenAI Batch job's results in OpenAI's batch output format: batch_output.jsonl and
batch_errors.jsonl, one line per request in input order (each request in exactly one file).

They are written from completions.parquet when the job finishes, each whole or not at all
(Store.write_stream, after `_SUCCESS` is withdrawn: the job commits again once they are there),
so a job killed at any moment and resumed writes them whole; a rerun of a finished job writes them
again, the same but for `created`. What the lines need beyond batchpage's own columns is in the
job's derived columns (`batch_schema`): the request's url, and the logprobs a request asked
for (as JSON, the chat shape; converted for /v1/completions here).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.output.files import (
    BATCH_ERRORS_FILE,
    BATCH_OUTPUT_FILE,
    FINAL_FILE,
    output_folder,
    read_job,
    store_of,
)
from batchpage.output.manifest import retract
from batchpage.request_outputs import RequestOutput
from batchpage.storage import Store

_COMPLETIONS_URL = "/v1/completions"
_EMBEDDINGS_URL = "/v1/embeddings"
_ERROR_CODE = "invalid_request"


def batch_schema() -> pa.Schema:
    """The derived columns of an OpenAI Batch job, after batchpage's own."""
    return pa.schema([("url", pa.string()), ("logprobs", pa.string())])


def logprobs_json(out: RequestOutput, top: int, token: Callable[[int], str]) -> str:
    """Each sample's per-token logprobs in the chat shape (token, logprob, bytes, top_logprobs),
    as JSON text: a list over the samples. `top` is how many alternatives the request asked
    for; `token` turns an id into its text."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    samples = []
    for o in out.outputs:
        tokens = []
        for token_id, lps in zip(o.token_ids, o.logprobs or [], strict=False):
            # The engine's dict holds the chosen token and the top-k; the chosen one counts
            # among the top only if it is one of the k most likely.
            best = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
            item = entry(token_id, lps[token_id])
            item["top_logprobs"] = [entry(t, lp) for t, lp in best]
            tokens.append(item)
        samples.append(tokens)
    return json.dumps(samples)


def write_batch_files(
    output_dir: str | os.PathLike, model: str, store: Store | None = None
) -> tuple[int, int]:
    """Write both files from completions.parquet; returns (requests answered, requests failed).
    `model` is what the responses name as their model (the job's, whatever the lines asked)."""
    out = output_folder(output_dir)
    store = store_of(out, store)
    job_key = str(read_job(out, store).get("fingerprint", ""))
    created = int(time.time())
    answered = failed = 0
    retract(store, out)
    with ExitStack() as stack:
        ok = stack.enter_context(store.write_stream(store.join(out, BATCH_OUTPUT_FILE)))
        err = stack.enter_context(store.write_stream(store.join(out, BATCH_ERRORS_FILE)))
        for rec in _records(store, store.join(out, FINAL_FILE)):
            key = _key(job_key, rec["index"])
            if rec["error"] is None:
                ok.write(_line(_answer(rec, key, model, created)))
                answered += 1
            else:
                err.write(_line(_failure(rec, key)))
                failed += 1
    return answered, failed


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record) + "\n").encode("utf-8")


def _records(store: Store, path: str) -> Iterator[dict[str, Any]]:
    columns = [
        "id",
        "index",
        "completion",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "error",
        "url",
        "logprobs",
    ]
    with store.open_read(path) as f:
        file = pq.ParquetFile(f)
        for derived in ("reasoning", "embedding"):  # a job with a reasoning parser; an embed job
            if derived in file.schema_arrow.names:
                columns.append(derived)
        for batch in file.iter_batches(batch_size=1024, columns=columns):
            yield from batch.to_pylist()


def _key(job_key: str, index: int) -> str:
    # Stable across rewrites of the same job, distinct between jobs and requests.
    return hashlib.sha256(f"{job_key}:{index}".encode()).hexdigest()[:24]


def _answer(rec: dict[str, Any], key: str, model: str, created: int) -> dict[str, Any]:
    if rec["url"] == _EMBEDDINGS_URL:
        return _response(key, rec["id"], _embedding_body(rec, model))
    completions = rec["url"] == _COMPLETIONS_URL
    texts, reasons = rec["completion"], rec["finish_reason"]
    logprobs = json.loads(rec["logprobs"]) if rec["logprobs"] else [None] * len(texts)
    thoughts = rec.get("reasoning") or [None] * len(texts)
    choices = []
    for i, (text, reason, lps) in enumerate(zip(texts, reasons, logprobs, strict=True)):
        if completions:
            choice = {"index": i, "text": text, "logprobs": _completion_logprobs(lps)}
        else:
            message = {"role": "assistant", "content": text, "refusal": None}
            if thoughts[i] is not None:  # where vLLM's server puts it
                message["reasoning"] = thoughts[i]
            lp = None if lps is None else {"content": lps, "refusal": None}
            choice = {"index": i, "message": message, "logprobs": lp}
        choices.append({**choice, "finish_reason": reason})
    prompt_tokens, completion_tokens = rec["prompt_tokens"] or 0, rec["completion_tokens"] or 0
    body = {
        "id": f"{'cmpl' if completions else 'chatcmpl'}-{key}",
        "object": "text_completion" if completions else "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": rec["cached_tokens"] or 0},
        },
    }
    return _response(key, rec["id"], body)


def _embedding_body(rec: dict[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's embeddings response: a float embedding per input, their tokens as usage."""
    tokens = rec["prompt_tokens"] or 0
    data = [
        {"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(rec["embedding"])
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _response(key: str, custom_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{key}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{key}", "body": body},
        "error": None,
    }


def _failure(rec: dict[str, Any], key: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{key}",
        "custom_id": rec["id"],
        "response": None,
        "error": {"code": _ERROR_CODE, "message": rec["error"]},
    }


def _completion_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The legacy completions shape; text offsets count from the completion's start (vLLM)."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [{e["token"]: e["logprob"] for e in t["top_logprobs"]} for t in tokens],
        "text_offset": offsets,
    }
