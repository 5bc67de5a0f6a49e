"""Stop checks for one sequence, and its text: decoded as it grows only when it must be.

A sequence with stop strings needs its text every step (a stop string can complete at any token),
so it is detokenized incrementally, below. Every other sequence is decoded once, when it finishes:
EOS, stop token ids and the length limits are checked on token ids alone.

Incremental detokenization decodes only a short window of recent tokens per step (never the
whole output), in the style of HF's TextStreamer and vLLM: ``window`` = the tokens from the
previous commit point on; the text it adds is ``decode(window)`` minus ``decode(window's
already-committed head)``. Decoding from an earlier token keeps context-dependent pieces right
(SentencePiece's leading space). It is written here rather than taken from the tokenizers
library's DecodeStream because that one holds a run of invalid bytes back for ever, decoding an
ever longer window each step; this one commits such a run once it cannot be a character.

A window whose text ends in U+FFFD usually ends in part of a multi-byte character (an emoji or CJK
character split across byte-level tokens): it is held back until the character completes, so the
committed text is always a prefix of the full decode and never changes afterwards. When the
sequence finishes, what is held back is flushed, so the final text equals
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
(without the stop token's text, and truncated at a stop string, see StopChecker): the same text
a sequence decoded once at its end gets (decode_once).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from batchpage.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 non-empty tokens. A window that still ends
# in U+FFFD after this many tokens is garbage bytes, not a character being built.
_MAX_PENDING = 16
# Prompt tokens decoded ahead of the output for context (leading spaces of the first token).
_CONTEXT_TOKENS = 4


Decode = Callable[[list[int]], str]


def usable_context(decode: Decode, context_ids: Sequence[int]) -> tuple[list[int], str]:
    """The prompt's last tokens decoded ahead of the output, and their text; none when the
    prompt ends mid-character (no clean cut point)."""
    context = list(context_ids[-_CONTEXT_TOKENS:])
    text = decode(context) if context else ""
    if text.endswith(_REPLACEMENT):
        return [], ""
    return context, text


def decode_once(decode: Decode, context_ids: Sequence[int], ids: list[int]) -> str:
    """The text of ``ids`` after the prompt's context, in one decode: what the incremental
    detokenizer commits in total, token by token."""
    context, context_text = usable_context(decode, context_ids)
    if not context:
        return decode(ids)
    text = decode(context + ids)
    return text[len(context_text) :] if text.startswith(context_text) else decode(ids)


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoded a few tokens at a time."""

    def __init__(self, decode: Decode, context_ids: Sequence[int] = ()) -> None:
        """``decode``: token ids to text (Tokenizer.decoder: with or without special tokens)."""
        self._decode = decode
        context, context_text = usable_context(decode, context_ids)
        self._tokens = list(context)  # context + output tokens
        self._prefix = 0  # the window starts here
        self._read = len(context)  # tokens before this are in ``text``
        self._prefix_text = context_text  # decode(tokens[prefix:read])
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text this commits (empty while a character is pending)."""
        self._tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Commit whatever is held back (the sequence is over)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._tokens):
            return ""
        window = self._decode(self._tokens[self._prefix :])
        if not window.endswith(_REPLACEMENT) or final:
            return self._commit(window, len(self._tokens))
        if len(self._tokens) - self._read > _MAX_PENDING:
            return self._commit_settled(window)
        return ""

    def _commit(self, window_text: str, upto: int) -> str:
        delta = window_text[len(self._prefix_text) :]
        self.text += delta
        self._prefix, self._read = self._read, upto
        self._prefix_text = self._decode(self._tokens[self._prefix : self._read])
        return delta

    def _commit_settled(self, window_text: str) -> str:
        """Commit all but the last 4 non-empty tokens when that head is already settled.

        Bytes before the last 4 non-empty tokens cannot belong to a character still being built,
        so their text is final if the whole window's text starts with it. This bounds the window
        when a model emits a long run of invalid bytes.
        """
        cut, non_empty = len(self._tokens), 0
        while cut > self._read and non_empty < 4:
            cut -= 1
            non_empty += bool(self._decode([self._tokens[cut]]))
        if non_empty < 4 or cut == self._read:
            return ""
        head = self._decode(self._tokens[self._prefix : cut])
        return self._commit(head, cut) if window_text.startswith(head) else ""


class StopDecision(NamedTuple):
    finish_reason: str  # "stop" or "length"
    stop_reason: str | int | None  # the stop string or stop token id; None for EOS and length


class StopChecker:
    """Follows one sequence's generated tokens: its text and when (and why) it must stop.

    Stops, in this order of precedence for one token:
    - EOS (one of ``eos_ids``, unless params.ignore_eos): "stop", stop_reason None;
    - a token of params.stop_token_ids: "stop", stop_reason the id;
      (the stop token stays in the token ids but its text is left out of ``text`` unless
      params.include_stop_str_in_output; neither counts while fewer than min_tokens tokens
      precede it, matching the sampler's min_tokens mask)
    - a stop string completed in the text: "stop", stop_reason the string; ``text`` is cut
      before it (after it with include_stop_str_in_output); checked once the output has
      min_tokens tokens; when several complete at once, the one ending first wins;
    - params.max_tokens output tokens, or prompt_len + output tokens reaching max_model_len:
      "length".
    """

    def __init__(
        self,
        decode: Decode,
        params: SamplingParams,
        eos_ids: Collection[int] = (),
        prompt_len: int = 0,
        max_model_len: int | None = None,
        context_ids: Sequence[int] = (),
        stream_text: bool = False,
        text_open: bool = True,
    ) -> None:
        """``decode``: token ids to text, honouring params.skip_special_tokens
        (Tokenizer.decoder). ``context_ids``: the prompt's last tokens, decoded ahead of the
        output as context so the first output token keeps its leading space (vLLM's
        behaviour); leave empty to get exactly ``decode(output_ids)``. ``stream_text``: keep
        ``text`` current every step although params has no stop strings (a caller that reads
        it each step, as a structured output's stop strings do); otherwise the text is decoded
        once, when it is first read after the sequence finishes. ``text_open=False``: the
        tokens are not text (a reasoning model's thinking) until ``open_text``; they count
        towards the limits and may stop the sequence, but stop strings are not looked for in
        them."""
        self.params = params
        self._eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self._stop_ids = frozenset(params.stop_token_ids or ())
        self._stops: list[str] = list(params.stop or ())
        self._prompt_len = prompt_len
        self._max_model_len = max_model_len
        self._max_tokens = params.max_tokens if params.max_tokens is not None else -1
        self._min_tokens = params.min_tokens
        self._decode = decode
        self._context_ids = list(context_ids)
        self._stream = bool(self._stops) or stream_text
        self._text_open = text_open
        self._detok: IncrementalDetokenizer | None = None
        if self._stream and text_open:
            self._detok = IncrementalDetokenizer(decode, context_ids)
        self._ids: list[int] = []  # the tokens of the text, without a stop token left out
        self._final_text: str | None = None
        self._text_end: int | None = None  # set when a stop string truncates the text
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def follows_each_token(self) -> bool:
        """Whether every token must be appended as it comes: its text is decoded as it grows
        (stop strings) or is not open yet (a reasoning model's thinking). Other checkers may
        skip tokens that cannot end them (`catch_up`)."""
        return self._stream or not self._text_open

    @property
    def ending_ids(self) -> frozenset[int]:
        """The tokens that stop the sequence once min_tokens are out: EOS and stop ids."""
        return self._eos | self._stop_ids

    @property
    def length_limit(self) -> int | None:
        """The number of output tokens at which it stops for length; None: no limit."""
        limits = [self._max_tokens] if self._max_tokens >= 0 else []
        if self._max_model_len is not None:
            limits.append(max(1, self._max_model_len - self._prompt_len))
        return min(limits, default=None)

    def catch_up(self, token_ids: list[int]) -> StopDecision | None:
        """Take the newest of token_ids (the sequence's prompt and output so far), with any
        output tokens before it that were not appended: the same decision as appending each in
        turn, given that none of those could stop it (no ending id, below the length limit), as
        the engine's batch checks make sure. Only a checker that does not follow each token may
        miss tokens."""
        missed = len(token_ids) - self._prompt_len - 1 - self.num_tokens
        if missed:
            if missed < 0 or self.follows_each_token:
                raise RuntimeError(f"catch_up: {missed} tokens missed, the checker follows each")
            self._ids += token_ids[self._prompt_len + self.num_tokens : -1]
            self.num_tokens += missed
        return self.append(token_ids[-1])

    @property
    def text(self) -> str:
        """The output text so far (final once finished)."""
        if self._detok is not None:
            text = self._detok.text
            return text if self._text_end is None else text[: self._text_end]
        if self._final_text is not None:
            return self._final_text
        text = decode_once(self._decode, self._context_ids, self._ids)
        if self.finished:
            self._final_text = text
        return text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def decode_span(self, context_ids: Sequence[int], ids: list[int]) -> str:
        """The text of ``ids`` after ``context_ids``, decoded as this sequence's text is."""
        return decode_once(self._decode, context_ids, ids)

    @property
    def text_open(self) -> bool:
        return self._text_open

    def open_text(self, context_ids: Sequence[int]) -> None:
        """The tokens appended from now on are the text (see ``text_open``); ``context_ids``:
        the tokens before them, decoded ahead as context."""
        if self._text_open:
            raise RuntimeError("the text is already open")
        self._text_open = True
        self._context_ids = list(context_ids[-_CONTEXT_TOKENS:])
        if self._stream:
            self._detok = IncrementalDetokenizer(self._decode, self._context_ids)

    def append(self, token_id: int) -> StopDecision | None:
        """Take the next generated token; return why the sequence stops, or None to go on."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason}); got {token_id}")
        self.num_tokens += 1
        if self.num_tokens > self._min_tokens and (
            token_id in self._eos or token_id in self._stop_ids
        ):
            if self.params.include_stop_str_in_output and self._text_open:
                self._add(token_id)
            if self._detok is not None:
                self._detok.flush()
            reason = None if token_id in self._eos else token_id
            return self._finish("stop", reason)

        last = self.num_tokens == self._max_tokens or self._at_model_len()
        if not self._text_open:
            return self._finish("length", None) if last else None
        if self._detok is None:
            self._ids.append(token_id)
            return self._finish("length", None) if last else None
        committed_before = len(self._detok.text)
        self._detok.add(token_id)
        if last:
            self._detok.flush()
        if self._stops and self.num_tokens >= self._min_tokens:
            hit = self._find_stop(committed_before)
            if hit is not None:
                start, stop = hit
                keep = self.params.include_stop_str_in_output
                self._text_end = start + len(stop) if keep else start
                return self._finish("stop", stop)
        return self._finish("length", None) if last else None

    def _add(self, token_id: int) -> None:
        if self._detok is None:
            self._ids.append(token_id)
        else:
            self._detok.add(token_id)

    def _at_model_len(self) -> bool:
        limit = self._max_model_len
        return limit is not None and self._prompt_len + self.num_tokens >= limit

    def _find_stop(self, committed_before: int) -> tuple[int, str] | None:
        """The stop string completed first in the newly committed text, as (start, string)."""
        assert self._detok is not None
        text = self._detok.text
        if len(text) == committed_before:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stops:
            # A match must end in the new text, so it starts at most len(stop) - 1 chars earlier.
            start = text.find(stop, max(0, committed_before - len(stop) + 1))
            if start >= 0 and (best is None or start + len(stop) < best[0] + len(best[1])):
                best = (start, stop)
        return best

    def _finish(self, finish_reason: str, stop_reason: str | int | None) -> StopDecision:
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return StopDecision(finish_reason, stop_reason)
