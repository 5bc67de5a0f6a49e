"""Reasoning models: where a completion's thinking ends and its answer begins, and the budget.

A reasoning model writes ``<think> ... </think>`` (its own markers) before the answer. With a
reasoning parser the engine follows each sequence's tokens through three states:

    BEFORE   the output may open a thinking block (Qwen3 in thinking mode writes ``<think>``
             first; any other first token starts the answer, with no thinking)
    THINKING the tokens are the reasoning; the end marker closes it
    ANSWER   the tokens are the answer: its text, stop strings and structured output

A sequence's first state comes from its prompt: a prompt that ends (but for whitespace) in the
start marker opens the output in THINKING (DeepSeek-R1's template, Qwen3-Thinking-2507's); one
that ends in the end marker opens it in ANSWER (Qwen3's template with enable_thinking=False, an
empty block), and then nothing is tracked; else BEFORE, where a format whose models always think
(``implicit_start``, DeepSeek-R1's) takes the first token as thinking unless it is a marker.
The split is on token ids, so it holds whether or not the markers are special tokens that the
text leaves out.

``thinking_token_budget=N``: after N thinking tokens the next tokens are forced to the end marker
(the sampler may only pick them), as vLLM and llama.cpp do, and the answer follows. max_tokens
still bounds the whole output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import xgrammar as xgr

from batchpage.engine.sampler import TokenMask

if TYPE_CHECKING:
    from batchpage.engine.sequence import Sequence as EngineSequence


class ReasoningFormat(NamedTuple):
    """A family's markers, as text."""

    start: str
    end: str
    implicit_start: bool  # the output is thinking from its first token, marker or not


# The formats by parser name (vLLM's --reasoning-parser names).
FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", implicit_start=False),
    "deepseek_r1": ReasoningFormat("<think>", "</think>", implicit_start=True),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", implicit_start=False),
}
REASONING_PARSERS = ("none", "auto", *FORMATS)
# A tokenizer holding this token is DeepSeek's, whose reasoning models always think.
_DEEPSEEK_ASSISTANT = "<｜Assistant｜>"


class ReasoningMarkers(NamedTuple):
    """A format resolved against one tokenizer: each marker is one token id."""

    name: str
    start_id: int
    end_id: int
    implicit_start: bool


class Phase(enum.Enum):
    BEFORE = "before"
    THINKING = "thinking"
    ANSWER = "answer"


def resolve_markers(
    parser: str | None, token_id: Callable[[str], int | None]
) -> ReasoningMarkers | None:
    """The markers of engine.reasoning_parser for this tokenizer (``token_id``: the id of a
    text that is exactly one token, else None). None for "none" (or None), and for "auto" when
    the vocabulary has no markers; a named parser whose markers the vocabulary lacks raises
    ValueError naming them."""
    if parser in (None, "none"):
        return None
    if parser == "auto":
        if token_id(_DEEPSEEK_ASSISTANT) is not None:
            parser = "deepseek_r1"
        else:
            found = [n for n, f in FORMATS.items() if _ids(f, token_id) is not None]
            if not found:
                return None
            parser = found[0]
    fmt = FORMATS.get(parser)
    if fmt is None:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
    ids = _ids(fmt, token_id)
    if ids is None:
        raise ValueError(
            f"reasoning_parser={parser!r} needs {fmt.start!r} and {fmt.end!r} as single tokens "
            "of the model's vocabulary, and this tokenizer lacks them: pick the parser of the "
            "model's family, or reasoning_parser=auto (or none)"
        )
    return ReasoningMarkers(parser, ids[0], ids[1], fmt.implicit_start)


def _ids(fmt: ReasoningFormat, token_id: Callable[[str], int | None]) -> tuple[int, int] | None:
    start, end = token_id(fmt.start), token_id(fmt.end)
    return None if start is None or end is None else (start, end)


def prompt_phase(
    markers: ReasoningMarkers, prompt_ids: Sequence[int], is_blank: Callable[[int], bool]
) -> Phase:
    """The phase a completion of this prompt starts in (see the module docstring). Only the
    prompt's tail is read: trailing whitespace tokens, then one token."""
    for token in reversed(prompt_ids):
        if token == markers.start_id:
            return Phase.THINKING
        if token == markers.end_id:
            return Phase.ANSWER
        if not is_blank(token):
            break
    return Phase.BEFORE


class ThinkingTracker:
    """One sequence's place between its thinking and its answer.

    ``append`` takes every generated token in order (the engine's, after sampling); the output
    ids from ``answer_start`` on are the answer, those in ``[reasoning_start, reasoning_end)``
    the reasoning (no markers). In BEFORE, a format with ``implicit_start`` thinks from the
    first token unless that token is a marker. Owned by its Sequence; kept through preemption
    (a fork is made before its first token, from the prompt, like its parent).
    """

    def __init__(self, markers: ReasoningMarkers, phase: Phase, budget: int | None) -> None:
        self.markers = markers
        self.phase = phase
        self.budget = budget  # thinking tokens allowed; None: no limit
        self.num_tokens = 0  # output tokens taken
        self.num_thinking = 0
        self.opened = phase is Phase.THINKING  # a thinking block was opened (prompt or output)
        self.reasoning_start = 0
        self.reasoning_end: int | None = None  # None: the thinking has not ended
        self.answer_start: int | None = 0 if phase is Phase.ANSWER else None

    def _thinks_next(self) -> bool:
        """Whether the next token, unless a marker, is thinking."""
        return self.phase is Phase.THINKING or (
            self.phase is Phase.BEFORE and self.markers.implicit_start
        )

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take: the end marker, once the budget is spent."""
        if self.budget is not None and self.num_thinking >= self.budget and self._thinks_next():
            return self.markers.end_id
        return None

    @property
    def answer_may_start(self) -> bool:
        """Whether the next token may be the answer's (a structured output then constrains it:
        in BEFORE, the constraint's tokens and the start marker are allowed)."""
        return not self._thinks_next()

    @property
    def may_open(self) -> bool:
        """Whether the next token may open a thinking block (the start marker, in BEFORE)."""
        return self.phase is Phase.BEFORE

    def is_answer_token(self, token: int) -> bool:
        """Whether ``token``, if taken next, belongs to the answer (does not change state)."""
        if self.phase is Phase.BEFORE and not self.markers.implicit_start:
            return token != self.markers.start_id
        return self.phase is Phase.ANSWER

    def append(self, token: int) -> bool:
        """Take the next output token; return whether it is part of the answer."""
        index = self.num_tokens
        self.num_tokens += 1
        if self.phase is Phase.ANSWER:
            return True
        if self.phase is Phase.BEFORE:
            if token == self.markers.start_id:
                self.phase, self.opened, self.reasoning_start = Phase.THINKING, True, index + 1
                return False
            if not self.markers.implicit_start:
                self.phase, self.answer_start = Phase.ANSWER, index
                return True
            self.phase, self.opened, self.reasoning_start = Phase.THINKING, True, index
        if token == self.markers.end_id:
            self.phase, self.reasoning_end, self.answer_start = Phase.ANSWER, index, index + 1
            return False
        self.num_thinking += 1
        return False

    def reasoning_ids(self, output_ids: Sequence[int]) -> list[int] | None:
        """The reasoning's token ids (the whole output when the thinking never ended); None
        when the output did not think."""
        if not self.opened:
            return None
        end = self.reasoning_end if self.reasoning_end is not None else len(output_ids)
        return list(output_ids[self.reasoning_start : end])


def reasoning_text(seq: EngineSequence) -> str | None:
    """The thinking's text of a sequence's output (no markers); None when it did not think."""
    thinking = seq.feature(ThinkingTracker)
    if thinking is None:
        return None
    ids = thinking.reasoning_ids(seq.output_token_ids)
    if ids is None:
        return None
    if thinking.reasoning_end is None and seq.result.finish_reason == "stop" and ids:
        ids = ids[:-1]  # the EOS or stop token that ended it while thinking
    start = seq.num_prompt_tokens + thinking.reasoning_start
    return seq.stop.decode_span(seq.token_ids[max(0, start - 4) : start], ids)


def allow_start_marker(mask: TokenMask, rows: Sequence[int], start_id: int) -> None:
    """Let the constrained ``rows`` (in BEFORE) also open a thinking block."""
    for row in rows:
        _set_bit(mask.bitmask, row, start_id)


def force_tokens(
    mask: TokenMask | None, forced: dict[int, int], num_rows: int, vocab_size: int
) -> TokenMask:
    """``mask`` (or none) with each row of ``forced`` allowed its one token only. Forced rows
    are thinking, so no grammar constrains them: they are not among ``mask``'s rows."""
    bitmask = mask.bitmask if mask is not None else xgr.allocate_token_bitmask(num_rows, vocab_size)
    for row, token in forced.items():
        bitmask[row].zero_()
        _set_bit(bitmask, row, token)
    rows = sorted({*(mask.rows if mask is not None else ()), *forced})
    return TokenMask(bitmask, rows)


def _set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    # int32 words: bit 31 is the sign bit.
    word, bit = divmod(token, 32)
    value = 1 << bit if bit < 31 else -(1 << 31)
    bitmask[row, word] |= value
