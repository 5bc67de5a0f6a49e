"""OpenAI-style chat messages -> the plain {role, content} turns a chat template renders.

Shared by the dataset rows, OpenAI Batch lines and LLM.chat, so that a conversation means the
same thing everywhere: content is a string or a list of text parts (joined with a newline, as
vLLM does for string-content templates), and the role is one that templates know. A role
outside that set is refused rather than rendered: most templates would print it verbatim as a
turn the model was never trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize_messages(value: Any) -> list[dict[str, str]]:
    """The conversation as [{role, content: str}, ...]; ValueError naming the bad message."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        what = "empty" if isinstance(value, Sequence) and not value else type(value).__name__
        raise ValueError(f"messages must be a non-empty list of {{role, content}} (got {what})")
    return [_message(i, m) for i, m in enumerate(value)]


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
        raise ValueError(f"messages[{i}] is not a {{role: str, content: str}} object")
    role = m["role"]
    if role not in ROLES:
        raise ValueError(
            f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)} "
            "(map other names, e.g. human/gpt, to user/assistant)"
        )
    return {"role": role, "content": _content(i, m.get("content"))}


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes) and content:
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                got = f"type {kind!r}" if kind else type(part).__name__
                raise ValueError(
                    f"messages[{i}].content[{j}] is not a text part ({got}); only "
                    '{"type": "text", "text": ...} parts are supported'
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(
        f"messages[{i}] is not a {{role: str, content: str}} object: content must be text or "
        f"a list of text parts (got {type(content).__name__})"
    )
