"""BeamSearchRunner: runs beam-search requests in lockstep over the paged KV cache.

Each step every live beam of every admitted group decodes one token in one forward. The next
beams are forked from their parents (KVCacheManager.fork: all blocks shared; a shared, partly
filled last block is copied on the first write by allocate), then the old beams are freed. A group
is admitted only when its worst case (`worst_case_blocks`) fits beside the groups already
running, so no beam is ever preempted mid-search. The engine runs beam requests after the
others, so the pool is theirs alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from batchpage.engine.beam_search import BeamGroup
from batchpage.engine.kv_manager import KVCacheManager, blocks_for
from batchpage.engine.model_runner import ModelRunner
from batchpage.engine.scheduler import ScheduledSeq, SchedulerOutput, commit_computed
from batchpage.engine.sequence import Request, SeqStatus, Sequence
from batchpage.engine.sequence_factory import SequenceFactory
from batchpage.engine.step_inputs import StepBuilder
from batchpage.metrics import RunStats
from batchpage.sampling_params import SamplingParams


def beam_max_len(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """The longest a beam of this request can grow, prompt included."""
    if params.max_tokens is None:
        return max_model_len
    return min(max_model_len, prompt_len + params.max_tokens)


def worst_case_blocks(
    params: SamplingParams, prompt_len: int, max_model_len: int, block_size: int
) -> int:
    """Every beam at its longest, each with one block of its own copied on write."""
    max_len = beam_max_len(params, prompt_len, max_model_len)
    return params.effective_beam_width * (blocks_for(max_len, block_size) + 1)


@dataclass
class _Group:
    req: Request
    search: BeamGroup
    beams: list[Sequence]  # running beams, in the search's order; one (the prompt) at first
    reserve: int  # blocks set aside for its worst case


class BeamSearchRunner:
    def __init__(
        self,
        kv: KVCacheManager,
        runner: ModelRunner,
        steps: StepBuilder,
        factory: SequenceFactory,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        """``steps`` is the engine's: beam steps run apart from the others, so they share it."""
        self.kv = kv
        self.runner = runner
        self.steps = steps
        self.factory = factory
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.pending: deque[Request] = deque()
        self.active: list[_Group] = []

    def add(self, req: Request) -> None:
        self.pending.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.active)

    def step(self, stats: RunStats, check_integrity: bool = False) -> list[Sequence]:
        """Admit what fits, decode one token for every live beam; returns the result sequences
        (the n best hypotheses) of each group that finished in this step."""
        self._admit(stats)
        if not self.active:
            raise RuntimeError("no beam group fits the KV pool: this is a bug")
        self._step(stats)
        if check_integrity:
            self.kv.check_integrity([b for g in self.active for b in g.beams])
        finished: list[Sequence] = []
        for g in [g for g in self.active if g.search.done]:
            finished += self._finish(g, stats)
            self.active.remove(g)
        return finished

    def _admit(self, stats: RunStats) -> None:
        reserved = sum(g.reserve for g in self.active)
        running = sum(g.search.width for g in self.active)
        while self.pending:
            req = self.pending[0]
            prompt_len = len(req.prompt_token_ids)
            need = worst_case_blocks(req.params, prompt_len, self.max_model_len, self.kv.block_size)
            width = req.params.effective_beam_width
            if self.active and (
                reserved + need > self.kv.num_blocks or running + width > self.max_num_seqs
            ):
                return
            self.pending.popleft()
            prompt = self.factory.make(req, 0)
            prompt.status = SeqStatus.RUNNING
            search = BeamGroup(
                width=width,
                prompt_len=prompt_len,
                max_len=beam_max_len(req.params, prompt_len, self.max_model_len),
                eos_ids=frozenset() if req.params.ignore_eos else self.factory.eos_ids,
                length_penalty=req.params.length_penalty,
                early_stopping=req.params.early_stopping,
            )
            prompt.num_cached_tokens = self.kv.lend_prefix(prompt)
            stats.cached_prompt_tokens += prompt.num_cached_tokens
            self.active.append(_Group(req, search, [prompt], need))
            reserved += need
            running += width

    def _step(self, stats: RunStats) -> None:
        scheduled, copies = [], []
        for g in self.active:
            for beam in g.beams:
                n = beam.num_uncomputed_tokens
                copies += self.kv.allocate(beam, n)
                scheduled.append(ScheduledSeq(beam, n))
        inputs = self.steps.build(scheduled, self.kv.take_changed())
        logits = self.runner.execute(inputs, SchedulerOutput(scheduled, copies)).logits
        stats.prefill_tokens_computed += commit_computed(scheduled, self.kv)
        self.steps.batch.advance(inputs.rows, inputs.num_new)
        stats.record_step(len(scheduled), 0, 0, self.kv.pool.num_used)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        row = 0
        for g in self.active:
            rows = logprobs[row : row + len(g.beams)]
            row += len(g.beams)
            if len(g.beams) == 1:  # the prompt: every beam starts from it
                stats.record_first_token()
                rows = rows.expand(g.search.width, -1)
            choices = g.search.step(rows)
            if g.search.done:
                continue
            parents = g.beams if len(g.beams) > 1 else g.beams * g.search.width
            children = []
            for i, c in enumerate(choices):
                parent = parents[c.parent]
                child = self.factory.make(g.req, i)
                self.kv.fork(parent, child)
                child.token_ids = parent.token_ids + [c.token]
                child.status = SeqStatus.RUNNING
                children.append(child)
            for old in g.beams:
                self.kv.free(old)
                self.steps.release(old)
            g.beams = children

    def _finish(self, g: _Group, stats: RunStats) -> list[Sequence]:
        for beam in g.beams:
            self.kv.free(beam)
            self.steps.release(beam)
        results = []
        for i, hyp in enumerate(g.search.best(g.req.params.n)):
            seq = self.factory.make(g.req, i)
            seq.token_ids += hyp.tokens
            seq.status = SeqStatus.FINISHED
            ended = bool(hyp.tokens) and hyp.tokens[-1] in g.search.eos_ids
            seq.finish_reason = "stop" if ended else "length"
            answer = hyp.tokens
            if seq.thinking is not None:  # the split of a reasoning model's output
                for token in hyp.tokens:
                    seq.thinking.append(token)
                start = seq.thinking.answer_start
                answer = hyp.tokens[start:] if start is not None else []
            skip = g.req.params.skip_special_tokens
            seq.text = self.factory.tokenizer.decode(answer, skip_special_tokens=skip)
            seq.cumulative_logprob = hyp.cum_logprob
            stats.generated_tokens += len(hyp.tokens)
            results.append(seq)
        return results
