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
sequences.
"""

from __future__ import annotations

import torch

from batchpage.engine.beam_group import BeamGroup, beam_max_len
from batchpage.engine.reasoning import ThinkingTracker
from batchpage.engine.scheduler import Scheduler
from batchpage.engine.sequence import Request, SeqStatus, Sequence
from batchpage.engine.sequence_factory import SequenceFactory
from batchpage.metrics import RunStats


class Beams:
    """The beam searches of an engine, keyed by request."""

    def __init__(self, scheduler: Scheduler, factory: SequenceFactory, max_model_len: int):
        self.scheduler = scheduler
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

    def advance(
        self, beams: list[Sequence], logits: torch.Tensor, stats: RunStats
    ) -> list[Sequence]:
        """One search step for the groups of `beams` (every live beam of each, contiguous and in
        the group's order, as the scheduler runs them), logits [len(beams), V] their rows.
        Returns the n best hypotheses of each group that ended; the old beams have left the
        running set (replaced by the next ones, or retired)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        finished: list[Sequence] = []
        start = 0
        while start < len(beams):
            req = beams[start].request
            end = start + 1
            while end < len(beams) and beams[end].request is req:
                end += 1
            old, rows = beams[start:end], logprobs[start:end]
            start = end
            search = self.groups[req]
            if len(old) == 1:  # the prompt: every beam starts from it
                stats.record_first_token()
                stats.cached_prompt_tokens += old[0].num_cached_tokens
                rows = rows.expand(search.width, -1)
            assert rows.shape[0] == search.width, "a beam group ran in part"
            choices = search.step(rows)
            if search.done:
                self.scheduler.retire(old)
                del self.groups[req]
                finished += self._results(req, search, stats)
                continue
            parents = old if len(old) > 1 else old * search.width
            children = []
            for i, choice in enumerate(choices):
                parent = parents[choice.parent]
                child = self.factory.make(req, i)
                self.scheduler.kv.fork(parent, child)
                child.token_ids = parent.token_ids + [choice.token]
                children.append(child)
            self.scheduler.replace(old, children)
        return finished

    def _results(self, req: Request, search: BeamGroup, stats: RunStats) -> list[Sequence]:
        results = []
        for i, hyp in enumerate(search.best(req.params.n)):
            seq = self.factory.make(req, i)
            seq.token_ids += hyp.tokens
            seq.status = SeqStatus.FINISHED
            ended = bool(hyp.tokens) and hyp.tokens[-1] in search.eos_ids
            seq.finish_reason = "stop" if ended else "length"
            answer = hyp.tokens
            thinking = seq.feature(ThinkingTracker)
            if thinking is not None:  # the split of a reasoning model's output
                for token in hyp.tokens:
                    thinking.append(token)
                begin = thinking.answer_start
                answer = hyp.tokens[begin:] if begin is not None else []
            skip = req.params.skip_special_tokens
            seq.text = self.factory.tokenizer.decode(answer, skip_special_tokens=skip)
            seq.cumulative_logprob = hyp.cum_logprob
            stats.generated_tokens += len(hyp.tokens)
            results.append(seq)
        return results
