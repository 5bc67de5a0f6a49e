"""Structured outputs at decode time: each constrained sequence holds a Constraint (its own
xgrammar matcher), and each step masks and advances all of them in one batched pass.

    mask = masks.fill(constraints)      # before sampling: allowed tokens of the constrained rows
    tokens = sample(..., token_mask=mask)
    advance(constraints, tokens)        # after sampling: every matcher takes its row's token

Samples of one request (n > 1) and forks each get their own matcher. A sequence keeps its
matcher through preemption (recompute or swap): the KV cache is rebuilt, the grammar state is
not lost. End-of-sequence (and the request's stop_token_ids) are allowed only where the grammar
is complete, so an output that ends on one of them is a complete match.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import xgrammar as xgr

from batchpage.engine.sampler import TokenMask


class StopHit(NamedTuple):
    stop: str  # the stop string
    end: int  # the output text is cut here (before the string, or after it when it is kept)


class Constraint:
    """One sequence's place in its grammar.

    Stop strings are checked here rather than by the StopChecker: a stop string ends a
    constrained output only where the text it leaves is a complete match of the grammar
    (elsewhere it is part of the structured output), so an output that finishes with "stop"
    always parses.
    """

    def __init__(
        self,
        grammar: xgr.CompiledGrammar,
        stop_token_ids: Collection[int],
        stops: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._grammar = grammar
        self._stop_token_ids = sorted(stop_token_ids)
        self.matcher = self._new_matcher()
        self._stops = list(stops)
        self._include_stop = include_stop_str_in_output
        self._scanned = 0  # output text already searched for stop strings

    def _new_matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self._grammar, override_stop_tokens=self._stop_token_ids or None)

    @property
    def has_stops(self) -> bool:
        """Whether find_stop needs the output text each step."""
        return bool(self._stops)

    def find_stop(self, text: str) -> StopHit | None:
        """The stop string, completed in the text added since the last call, that ends the
        output first at a point where the grammar is complete; None if there is none."""
        if not self._stops:
            return None
        hits = []
        for stop in self._stops:
            start = text.find(stop, max(0, self._scanned - len(stop) + 1))
            while start >= 0:
                hits.append((start + len(stop), start, stop))
                start = text.find(stop, start + 1)
        self._scanned = len(text)
        for _, start, stop in sorted(hits):
            end = start + len(stop) if self._include_stop else start
            if self.is_complete(text[:end]):
                return StopHit(stop, end)
        return None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from where the grammar stands, it accepts before one
        it rejects or one that ends it (the drafts a row may run: speculative decoding; the
        position after an end has no mask to draw from, and the row draws the end itself);
        the matcher is left where it was."""
        taken = 0
        for token in tokens:
            if not self.matcher.accept_token(int(token)):
                break
            taken += 1
            if self.matcher.is_terminated():
                taken -= 1
                self.matcher.rollback(1)
                break
        if taken:
            self.matcher.rollback(taken)
        return taken

    def is_complete(self, text: str) -> bool:
        """Whether ``text`` is a whole sentence of the grammar (checked on a fresh matcher)."""
        matcher = self._new_matcher()
        return matcher.accept_string(text) and matcher.is_completed()


class GrammarMasks:
    """Fills the token bitmask of a step's constrained rows in one call (xgrammar's batched
    matcher, on its own threads)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the logits' width
        self._batch = xgr.BatchGrammarMatcher()

    def fill(
        self,
        constraints: Sequence[Constraint | None],
        drafted: Sequence[Sequence[int]] | None = None,
    ) -> TokenMask | None:
        """The mask for the rows whose constraint is set; None when no row has one. A row that
        ran drafts (speculative decoding) has a logits row per position: `drafted[i]` are the
        drafts before row i's position (its row's first offset drafts), and row i's mask is
        the grammar's after them. The positions are filled depth by depth, each matcher taking
        its draft between, then rolled back: every matcher ends where it began."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(constraints), self.vocab_size)
        depth = {i: 0 if drafted is None else len(drafted[i]) for i in rows}
        ran: dict[int, tuple[Constraint, int]] = {}  # each matcher and the drafts it takes
        for d in range(max(depth.values()) + 1):
            at = [i for i in rows if depth[i] == d]
            for i in at if d else ():  # the draft before this position
                constraint = constraints[i]
                assert constraint is not None and drafted is not None
                if not constraint.matcher.accept_token(int(drafted[i][d - 1])):
                    raise RuntimeError("a row ran a draft its grammar rejects: this is a bug")
                ran[id(constraint)] = (constraint, d)
            if at:
                matchers = [constraints[i].matcher for i in at]  # type: ignore[union-attr]
                self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=at)
        for constraint, taken in ran.values():
            constraint.matcher.rollback(taken)
        return TokenMask(bitmask, rows)


def advance(constraints: Sequence[Constraint | None], tokens: Sequence[int]) -> None:
    """Each constrained row's matcher takes its sampled token (one batched call)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    matchers = [constraints[i].matcher for i in rows]  # type: ignore[union-attr]
    accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [tokens[i] for i in rows])
    rejected = [tokens[i] for i, ok in zip(rows, accepted, strict=True) if not ok]
    if rejected:
        # The mask allowed only tokens the grammar accepts: a rejection means a bug upstream.
        raise RuntimeError(f"the grammar rejected sampled tokens {rejected}: this is a bug")
