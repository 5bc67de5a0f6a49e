"""The prompts LLM's methods take: one prompt or a list, each text, token ids, or vLLM's
TextPrompt / TokensPrompt dict of either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PromptType = str | list[int] | dict[str, Any]


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, never a token to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[Any]:
    if isinstance(prompts, str | dict):  # one prompt (a dict: vLLM's TextPrompt / TokensPrompt)
        return [prompts]
    prompts = list(prompts)
    if prompts and all(is_token_id(t) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
