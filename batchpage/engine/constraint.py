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

    def fill(self, constraints: Sequence[Constraint | None]) -> TokenMask | None:
        """The mask for the rows whose constraint is set; None when no row has one."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(constraints), self.vocab_size)
        matchers = [constraints[i].matcher for i in rows]  # type: ignore[union-attr]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
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
