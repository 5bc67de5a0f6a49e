"""The benchmarks' prompt sets, built from real data before any engine loads.

- `sample_sharegpt`: a seeded sample of ShareGPT first-turn prompts (chat-templated token ids)
  with their real reply lengths as target output lengths, both capped.
- `sharegpt_records`, `short_sharegpt_questions`: ShareGPT text for workloads built on top (shared
  system prompts, documents).
- `text_of_tokens`, `common_prefix_len`: token-level cutting and measuring of prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ChatTokenizer(Protocol):
    """The two tokenizer operations a workload needs (batchpage's Tokenizer has both)."""

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class WorkloadRequest:
    id: str
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate: the real reply's length, clamped to the caps
    reply_len: int  # the real reply's uncapped token length (for the record)


def _sharegpt_columns() -> tuple[list[Any], list[str | None], list[str | None]]:
    """(ids, first-turn prompts, first replies) of the bundled ShareGPT preset, in file order."""
    import pyarrow.parquet as pq

    from batchpage.data.presets import resolve_preset

    table = pq.read_table(resolve_preset("sharegpt").path, columns=["id", "prompt", "reply"])
    ids, prompts, replies = (table.column(c).to_pylist() for c in ("id", "prompt", "reply"))
    return ids, prompts, replies


def sample_sharegpt(
    tokenizer: ChatTokenizer,
    n: int,
    seed: int = 0,
    max_prompt_tokens: int = 256,
    max_output_tokens: int = 128,
    min_output_tokens: int = 4,
    chat_template: bool = True,
) -> list[WorkloadRequest]:
    """n ShareGPT V3 first turns in a seeded random order (the order is the workload's order).

    Prompts longer than max_prompt_tokens (after the chat template) are skipped rather than
    truncated: a cut would drop the template's closing turn markers and change the task. Rows
    without a reply are skipped too, since the reply is what sets the output length.
    """
    ids, prompts, replies = _sharegpt_columns()
    order = list(range(len(ids)))
    random.Random(seed).shuffle(order)
    picked: list[WorkloadRequest] = []
    for row in order:
        if len(picked) == n:
            break
        prompt, reply = prompts[row], replies[row]
        if not prompt or not reply:
            continue
        if chat_template:
            prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            prompt_ids = tokenizer.encode(prompt)
        if len(prompt_ids) > max_prompt_tokens:
            continue
        reply_len = len(tokenizer.encode(reply, add_special_tokens=False))
        output_len = max(min_output_tokens, min(reply_len, max_output_tokens))
        picked.append(WorkloadRequest(str(ids[row]), list(prompt_ids), output_len, reply_len))
    if len(picked) < n:
        raise ValueError(
            f"only {len(picked)} ShareGPT prompts fit max_prompt_tokens={max_prompt_tokens}; "
            f"asked for {n}: raise the cap or lower n"
        )
    return picked


def workload_summary(requests: Sequence[WorkloadRequest]) -> dict[str, float | int]:
    prompt = [len(r.prompt_token_ids) for r in requests]
    output = [r.output_len for r in requests]
    return {
        "requests": len(requests),
        "prompt_tokens": sum(prompt),
        "prompt_tokens_mean": sum(prompt) / len(prompt),
        "prompt_tokens_max": max(prompt),
        "output_tokens": sum(output),
        "output_tokens_mean": sum(output) / len(output),
        "output_tokens_min": min(output),
        "output_tokens_max": max(output),
    }


def sharegpt_records(seed: int = 0) -> list[tuple[str, str, str]]:
    """(id, first-turn prompt, first reply) of every ShareGPT row with both, in a seeded order."""
    ids, prompts, replies = _sharegpt_columns()
    rows = [(str(i), p, r) for i, p, r in zip(ids, prompts, replies, strict=True) if p and r]
    random.Random(seed).shuffle(rows)
    return rows


def short_sharegpt_questions(
    tokenizer: ChatTokenizer, n: int, seed: int = 0, max_tokens: int = 48, min_tokens: int = 4
) -> list[str]:
    """n distinct ShareGPT first-turn prompts of min_tokens..max_tokens tokens (plain encoding):
    the short, distinct user turns that follow a shared system prompt or document."""
    picked: list[str] = []
    seen: set[str] = set()
    for _, prompt, _ in sharegpt_records(seed):
        text = prompt.strip()
        if text in seen:
            continue
        if min_tokens <= len(tokenizer.encode(text, add_special_tokens=False)) <= max_tokens:
            picked.append(text)
            seen.add(text)
            if len(picked) == n:
                return picked
    raise ValueError(f"only {len(picked)} ShareGPT prompts have {min_tokens}..{max_tokens} tokens")


def text_of_tokens(tokenizer: Any, text: str, num_tokens: int) -> str:
    """The start of `text` cut to num_tokens tokens (plain encoding), as text again."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, {num_tokens} asked for")
    return tokenizer.decode(ids[:num_tokens])


def common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix that every sequence starts with."""
    if not sequences:
        return 0
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n
