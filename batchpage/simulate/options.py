"""The output-length assumption of an estimate, as the dry run (plan.output_tokens) and
LLM.estimate (output_tokens=) take it."""

from __future__ import annotations

from typing import NamedTuple


class OutputTokens(NamedTuple):
    kind: str  # "max" | "given" | "sample"
    value: int = 0  # the given length, or the rows to generate for real


def parse_output_tokens(text: str) -> OutputTokens:
    """`max`, a number of tokens, or `sample:N`; ValueError naming the forms."""
    text = text.strip()
    if text == "max":
        return OutputTokens("max")
    kind, sep, count = text.partition("sample:")
    value = count if sep and not kind else text
    if value.isdigit() and int(value) >= 1:
        return OutputTokens("sample" if sep else "given", int(value))
    raise ValueError(
        f"output_tokens={text!r}: give max (every row to its max_tokens), a number of "
        "tokens each row generates, or sample:N (generate N rows for real to learn the lengths)"
    )
