"""BeamSearchRunner: runs beam-search requests in lockstep over the paged KV cache.

Each step every live beam of every admitted group decodes one token in one forward. The next
beams are forked from their parents (KVCacheManager.fork: all blocks shared; a shared, partly
filled last block is copied on the first write by allocate), then the old beams are freed. A group
is admitted only when its worst case (width sequences of max length, plus one copied block each)
fits beside the groups already running, so no beam is ever preempted mid-search.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchpage.cache.kv_manager import blocks_for
from batchpage.engine.beam_search import BeamGroup
from batchpage.engine.scheduler import ScheduledSeq, SchedulerOutput
from batchpage.engine.sequence import Request, SeqStatus, Sequence
from batchpage.engine.step_inputs import build_step
from batchpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchpage.engine.engine import Engine, _Run


@dataclass
class _Group:
    req: Request
    search: BeamGroup
    beams: list[Sequence]  # running beams, in the search's order; one (the prompt) at first
    reserve: int  # blocks set aside for its worst case


class BeamSearchRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kv = engine.kv_manager

    def worst_case_blocks(self, req: Request) -> int:
        return self.worst_case_blocks_for(req.params, self._max_len(req))

    def worst_case_blocks_for(self, params: SamplingParams, max_len: int) -> int:
        """Every beam at max_len tokens, each with one block of its own copied on write."""
        return params.effective_beam_width * (blocks_for(max_len, self.kv.block_size) + 1)

    def _max_len(self, req: Request) -> int:
        limit = self.engine.max_model_len
        if req.params.max_tokens is not None:
            limit = min(limit, len(req.prompt_token_ids) + req.params.max_tokens)
        return limit

    def run(self, requests: list[Request], run: _Run) -> None:
        pending = deque(requests)
        active: list[_Group] = []
        while pending or active:
            self._admit(pending, active, run)
            if not active:
                raise RuntimeError("no beam group fits the KV pool: this is a bug")
            self._step(active, run)
            for g in [g for g in active if g.search.done]:
                self._finish(g, run)
                active.remove(g)

    def _admit(self, pending: deque[Request], active: list[_Group], run: _Run) -> None:
        reserved = sum(g.reserve for g in active)
        running = sum(g.search.width for g in active)
        while pending:
            req = pending[0]
            need, width = self.worst_case_blocks(req), req.params.effective_beam_width
            if active and (
                reserved + need > self.kv.num_blocks
                or running + width > self.engine.cfg.max_num_seqs
            ):
                return
            pending.popleft()
            prompt = self.engine.factory.make(req, 0)
            prompt.status = SeqStatus.RUNNING
            search = BeamGroup(
                width=width,
                prompt_len=len(req.prompt_token_ids),
                max_len=self._max_len(req),
                eos_ids=frozenset() if req.params.ignore_eos else self.engine.eos_ids,
                length_penalty=req.params.length_penalty,
                early_stopping=req.params.early_stopping,
            )
            prompt.num_cached_tokens = self.kv.lend_prefix(prompt)
            run.stats.cached_prompt_tokens += prompt.num_cached_tokens
            active.append(_Group(req, search, [prompt], need))
            reserved += need
            running += width

    def _step(self, active: list[_Group], run: _Run) -> None:
        scheduled, copies = [], []
        for g in active:
            for beam in g.beams:
                n = beam.num_uncomputed_tokens
                copies += self.kv.allocate(beam, n)
                scheduled.append(ScheduledSeq(beam, n))
        inputs = build_step(scheduled, self.kv.block_size, self.engine.device)
        logits, _ = self.engine.runner.execute(inputs, SchedulerOutput(scheduled, copies))
        stats = run.stats
        for s in scheduled:
            if s.num_new_tokens > 1:
                stats.prefill_tokens_computed += s.num_new_tokens
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.num_new_tokens > 1:
                self.kv.cache_progress(s.seq)
        stats.record_step(len(scheduled), 0, 0, self.kv.pool.num_used)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        row = 0
        for g in active:
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
                child = self.engine.factory.make(g.req, i)
                self.kv.fork(parent, child)
                child.token_ids = parent.token_ids + [c.token]
                child.status = SeqStatus.RUNNING
                children.append(child)
            for old in g.beams:
                self.kv.free(old)
            g.beams = children
        if self.engine.check_integrity_each_step:
            self.kv.check_integrity([b for g in active for b in g.beams])

    def _finish(self, g: _Group, run: _Run) -> None:
        for beam in g.beams:
            self.kv.free(beam)
        tokenizer = self.engine.factory.tokenizer
        results = []
        for i, hyp in enumerate(g.search.best(g.req.params.n)):
            seq = self.engine.factory.make(g.req, i)
            seq.token_ids += hyp.tokens
            seq.status = SeqStatus.FINISHED
            ended = bool(hyp.tokens) and hyp.tokens[-1] in g.search.eos_ids
            seq.finish_reason = "stop" if ended else "length"
            skip = g.req.params.skip_special_tokens
            seq.text = tokenizer.decode(hyp.tokens, skip_special_tokens=skip)
            seq.beam_score = hyp.score
            run.stats.generated_tokens += len(hyp.tokens)
            results.append(seq)
            if run.on_finish is not None:
                run.on_finish(seq, run.stats)
        run.by_request[g.req.index] = results
