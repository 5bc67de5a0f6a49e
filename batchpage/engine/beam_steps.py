"""Beam search inside the engine's one loop: beams are sequences that fork and are pruned.

A beam-search request enters the scheduler as one sequence, its prompt (`Beams.add`). The
scheduler admits it only when every beam search's worst case (`worst_case_blocks`) fits the pool
together, keeps beam-search sequences ahead of the others in its running set, schedules a
group's beams in one step or not at all, and never preempts them (scheduler.py), so a beam never
waits for a block another beam holds. After each step the engine hands the rows of the beams
that ran to `Beams.advance`: each group takes one search step (beam_search.BeamGroup, HF's
rules), its next beams are forked from their parents (KVCacheManager.fork: all blocks shared, a
shared partly filled last block copied at its next write) and take their parents' place in the
running set; a finished group's beams leave, and its n best hypotheses come back as finished
sequences. The search decides (BeamOutcome); the step's commit (commit.py) applies it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from batchpage.engine.beam_group import BeamGroup, beam_max_len
from batchpage.engine.reasoning import ThinkingTracker
from batchpage.engine.sequence import Request, SeqStatus, Sequence
from batchpage.engine.sequence_factory import SequenceFactory


class BeamOutcome(NamedTuple):
    """One beam search's step, for the step's commit (engine/commit.py): `old` beams leave the
    running set; `children` (parent, child, token: the child is a fresh sequence that forks
    parent and takes token) take their place, or, when the search ended, `results` (its n best
    hypotheses, finished sequences) come back. `first`: this step sampled the search's first
    token (its prompt just computed)."""

    old: list[Sequence]
    children: list[tuple[Sequence, Sequence, int]]
    results: list[Sequence] | None
    first: bool


class Beams:
    """The beam searches of an engine, keyed by request."""

    def __init__(self, factory: SequenceFactory, max_model_len: int):
        self.factory = factory
        self.max_model_len = max_model_len
        self.groups: dict[Request, BeamGroup] = {}

    def add(self, req: Request) -> Sequence:
        """The prompt sequence of a beam-search request, for the scheduler's queue."""
        params, prompt_len = req.params, len(req.prompt_token_ids)
        self.groups[req] = BeamGroup(
            width=params.effective_beam_width,
            prompt_len=prompt_len,
            max_len=beam_max_len(params, prompt_len, self.max_model_len),
            eos_ids=frozenset() if params.ignore_eos else self.factory.eos_ids,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        return self.factory.make(req, 0)

    def advance(self, beams: list[Sequence], logits: torch.Tensor) -> list[BeamOutcome]:
        """One search step for the groups of `beams` (every live beam of each, contiguous and in
        the group's order, as the scheduler runs them), logits [len(beams), V] their rows.
        Returns each group's outcome, for the step's commit to apply."""
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        outcomes: list[BeamOutcome] = []
        start = 0
        while start < len(beams):
            req = beams[start].request
            end = start + 1
            while end < len(beams) and beams[end].request is req:
                end += 1
            old, rows = beams[start:end], logprobs[start:end]
            start = end
            search = self.groups[req]
            first = len(old) == 1
            if first:  # the prompt: every beam starts from it
                rows = rows.expand(search.width, -1)
            assert rows.shape[0] == search.width, "a beam group ran in part"
            choices = search.step(rows)
            if search.done:
                del self.groups[req]
                outcomes.append(BeamOutcome(old, [], self._results(req, search), first))
                continue
            parents = old if len(old) > 1 else old * search.width
            children = [
                (parents[c.parent], self.factory.make(req, i), c.token)
                for i, c in enumerate(choices)
            ]
            outcomes.append(BeamOutcome(old, children, None, first))
        return outcomes

    def _results(self, req: Request, search: BeamGroup) -> list[Sequence]:
        results = []
        for i, hyp in enumerate(search.best(req.params.n)):
            seq = self.factory.make(req, i)
            seq.token_ids += hyp.tokens
            seq.status = SeqStatus.FINISHED
            ended = bool(hyp.tokens) and hyp.tokens[-1] in search.eos_ids
            out = seq.result
            out.finish_reason = "stop" if ended else "length"
            answer = hyp.tokens
            thinking = seq.feature(ThinkingTracker)
            if thinking is not None:  # the split of a reasoning model's output
                for token in hyp.tokens:
                    thinking.append(token)
                begin = thinking.answer_start
                answer = hyp.tokens[begin:] if begin is not None else []
            skip = req.params.skip_special_tokens
            out.text = self.factory.tokenizer.decode(answer, skip_special_tokens=skip)
            out.cumulative_logprob = hyp.cum_logprob
            results.append(seq)
        return results
