"""Engine: the step loop. schedule -> build step tensors -> execute -> sample -> stop checks.

State flows one way: the scheduler decides, step_inputs builds the tensors, the model runner
executes, the KV cache manager owns the blocks. The engine moves results between them, records
the metrics, and hands back the sequences that finished in each step; it never calls out.

    engine.add_requests(requests)      # returns the RunStats the following steps fill
    while engine.has_unfinished():
        for seq in engine.step(): ...  # finished sequences, as they finish
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from batchpage.engine.beam_steps import Beams
from batchpage.engine.config import EngineConfig
from batchpage.engine.constraint import Constraint, GrammarMasks, advance
from batchpage.engine.grammar_cache import GrammarCache
from batchpage.engine.kv_manager import KVCacheManager
from batchpage.engine.model_runner import Peers, build_model_runner
from batchpage.engine.plan import EnginePlan
from batchpage.engine.pooled_states import PoolingType, PoolSum, pooled_vector, uses_score_head
from batchpage.engine.reasoning import (
    ThinkingTracker,
    allow_start_marker,
    force_tokens,
    resolve_markers,
)
from batchpage.engine.sampler import (
    Penalties,
    SamplerOutput,
    TopLogprobs,
    compute_logprobs,
    draw_keys,
    sample,
    sample_greedy,
)
from batchpage.engine.scheduler import build_scheduler
from batchpage.engine.sequence import Request, Sequence
from batchpage.engine.sequence_factory import SequenceFactory
from batchpage.engine.step_inputs import StepBuilder, StepInputs
from batchpage.engine.stop_checker import StopDecision
from batchpage.host_memory import keep_freed_memory
from batchpage.metrics import RunStats
from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.score_head import token_classifier
from batchpage.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BEAM_SEARCH_WITH_CONSTRAINT = (
    "structured_outputs cannot be combined with use_beam_search: use sampling or greedy "
    "decoding (n > 1 for several candidates)"
)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        plan: EnginePlan,
        peers: Peers | None = None,
    ) -> None:
        """`peers`: the model is rank 0's share of a tensor-parallel group, whose other ranks
        (distributed/workers.py) run every step with it."""
        self.cfg = cfg
        self.plan = plan
        self.device = plan.device
        self.max_model_len = plan.max_model_len
        if plan.device.type == "cpu":
            keep_freed_memory()  # see host_memory.py: freed pages are not faulted in again
        self.scheduler = build_scheduler(
            cfg, plan.num_blocks, plan.max_model_len, cfg.batched_tokens(plan.device)
        )
        self.kv_manager: KVCacheManager = self.scheduler.kv
        if cfg.classifier_from_token is not None:  # before bind: the lm_head as loaded
            rows = model.head_rows(_token_ids(tokenizer, cfg.classifier_from_token))
            model.score = token_classifier(rows, model.embed_tokens.weight.dtype)
        # Linears are measured with the threads rank 0 runs its steps with.
        with peers.rank_threads() if peers is not None else contextlib.nullcontext():
            built = build_model_runner(model, cfg, plan, peers)
        self.bind_report = built.bind_report
        self.linear_methods = built.linear_methods
        self.linear_measurement = built.linear_measurement
        self.weight_bytes = model.weight_bytes()  # after bind: in the layouts the ops keep
        # The all-greedy sampler's argmax: the bound layer ops' (the C++ one on the CPU kernels).
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = built.argmax
        # The sampled rows' draw: the bound layer ops' exponential race (C++ on the CPU kernels).
        self.race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = built.race
        # A pooling model's requests finish when their prompt is computed (pooled_states.py).
        self.task = plan.task
        self.pooling = None if plan.task == "generate" else PoolingType(cfg.pooling_type)
        self.model = model
        self.runner = built.runner
        # The LoRA adapters read so far (enable_lora), which requests are checked against.
        self.adapters = built.runner.adapters
        self.eos_ids = tokenizer.eos_token_ids
        self.grammars = GrammarCache(tokenizer.hf, model_cfg.vocab_size, self.eos_ids)
        self.masks = GrammarMasks(model_cfg.vocab_size)
        self.reasoning = resolve_markers(cfg.reasoning_parser, tokenizer.single_token_id)
        self.factory = SequenceFactory(
            tokenizer, self.eos_ids, plan.max_model_len, cfg.seed, self.reasoning
        )
        self.batch = self.scheduler.batch  # the running sequences' rows
        self.step_builder = StepBuilder(self.batch, cfg.block_size, plan.device)
        self.beams = Beams(self.scheduler, self.factory, plan.max_model_len)
        self.stats = self._new_stats()
        self._started: set[int] = set()  # requests of this run that produced a token
        # Tests set this to check every invariant after every step.
        self.check_integrity_each_step = False

    def _new_stats(self) -> RunStats:
        stats = RunStats(self.kv_manager.num_blocks, self.cfg.block_size)
        stats.weight_bytes = self.weight_bytes
        stats.weight_formats = dict(self.bind_report.weight_formats)
        stats.linear_methods = dict(self.linear_methods)
        stats.linear_measurement = dict(self.linear_measurement)
        return stats

    def add_requests(self, requests: list[Request]) -> RunStats:
        """Queue every valid request (those with an error are skipped). When nothing was running,
        this starts a new run: the returned RunStats is filled by the steps that follow.

        A request with structured_outputs gets its grammar compiled here unless the caller did
        it (LLM does, to turn a bad constraint into that request's error); a bad one raises
        ValueError, as does one combined with beam search."""
        if not self.has_unfinished():
            self.stats = self._new_stats()
            self._started = set()
        share = self.cfg.kv_allocator == "paged"
        seqs: list[Sequence] = []
        for req in requests:
            if req.error is not None:
                continue
            if (req.pooling is None) != (self.pooling is None):
                raise ValueError(
                    f"a {'pooling' if req.pooling else 'generation'} request for an engine whose "
                    f"task is {self.task}"
                )
            self._compile_grammar(req)
            self.stats.requests += 1
            self.stats.prompt_tokens += len(req.prompt_token_ids)
            if req.params.use_beam_search:
                seqs.append(self.beams.add(req))
            else:
                seqs += self.factory.for_request(req, share_prompt=share)
        self.scheduler.add_batch(seqs)
        return self.stats

    def _compile_grammar(self, req: Request) -> None:
        constraint = req.params.structured_outputs
        if constraint is None or req.grammar is not None:
            return
        if req.params.use_beam_search:
            raise ValueError(BEAM_SEARCH_WITH_CONSTRAINT)
        req.grammar = self.grammars.compile(constraint)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward over the scheduled tokens; returns the sequences that finished in it
        (a beam search's: its best hypotheses, when it ends)."""
        if not self.scheduler.has_unfinished():
            self._finish_run_if_done()
            return []
        stats = self.stats
        parts, clock = stats.step_time_s, time.perf_counter
        t0 = clock()
        out = self.scheduler.schedule()
        if not len(out.rows):
            raise RuntimeError("the scheduler could not run any sequence: this is a bug")
        stats.preemptions += len(out.preempted)
        stats.swaps += len(out.swap_out)
        t1 = clock()
        inputs = self.step_builder.build(out.rows, out.num_new)
        blocks_used = self.kv_manager.pool.num_used  # during the forward, before any frees
        t2 = clock()
        logits, prompt_logits, pooled = self.runner.execute(inputs, out)
        t3 = clock()
        parts["schedule"] += t1 - t0
        parts["inputs"] += t2 - t1
        parts["forward"] += t3 - t2
        if prompt_logits is not None:
            self._score_prompts(inputs, prompt_logits)
        stats.prefill_tokens_computed += self.scheduler.update_from_output(out)
        parts["commit"] += clock() - t3
        if self.pooling is not None:
            finished = self._pool(inputs, logits, pooled)
        elif len(inputs.sample_rows):
            finished = self._sample(inputs, logits)
        else:
            finished = []
        t4 = clock()
        computed, blocks = self.batch.held()
        stats.record_step(
            num_running=len(self.scheduler.running),
            used_slots=computed,
            reserved_slots=blocks * self.cfg.block_size,
            blocks_used=blocks_used,
        )
        parts["commit"] += clock() - t4
        if self.check_integrity_each_step:
            self.scheduler.check_integrity()
        self._finish_run_if_done()
        return finished

    def run(self, requests: list[Request]) -> tuple[dict[int, list[Sequence]], RunStats]:
        """Runs every valid request to completion; returns its sequences by request index."""
        stats = self.add_requests(requests)
        by_request: dict[int, list[Sequence]] = {}
        while self.has_unfinished():
            for seq in self.step():
                by_request.setdefault(seq.request.index, []).append(seq)
        stats.finish()  # a run of error requests only takes no step
        return by_request, stats

    def _finish_run_if_done(self) -> None:
        if not self.has_unfinished():
            self.stats.finish()

    @staticmethod
    def _score_prompts(inputs: StepInputs, logits: torch.Tensor) -> None:
        targets = torch.tensor(inputs.prompt_targets)
        wanted = [s.params.prompt_logprobs for s, n in inputs.prompt_owners for _ in range(n)]
        scored = compute_logprobs(logits, targets, wanted)
        row = 0
        for seq, n in inputs.prompt_owners:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs += scored[row : row + n]
            row += n

    def _pool(
        self, inputs: StepInputs, last_rows: torch.Tensor, pooled: torch.Tensor | None
    ) -> list[Sequence]:
        """Pooling requests: sum this step's MEAN / CLS rows; those whose prompt is now
        computed get the head's output on their pooled vector and finish."""
        row = 0
        for seq, start, n in inputs.pool_owners:
            assert pooled is not None
            pool_sum = seq.feature(PoolSum)
            if pool_sum is None:
                pool_sum = PoolSum()
                seq.attach(pool_sum)
            pool_sum.add_chunk(start, pooled[row : row + n])
            row += n
        seqs = self.batch.seqs(inputs.sample_rows)
        if not seqs:
            return []
        pooling = self.pooling
        assert pooling is not None
        vectors = [
            pooled_vector(pooling, _pool_total(s), last_rows[i], s.num_prompt_tokens)
            for i, s in enumerate(seqs)
        ]
        stacked = torch.stack([v.to(last_rows.dtype) for v in vectors])
        with torch.inference_mode():
            outputs = self.model.pool_head(stacked) if uses_score_head(self.task) else stacked
        outputs = outputs.float().cpu()
        for seq, out in zip(seqs, outputs, strict=True):
            seq.pooled = out
            seq.detach(PoolSum)
            seq.finish_reason = "stop"
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
            self.scheduler.finish(seq)
        return seqs

    def _fork_samples(
        self, rows: np.ndarray, logits: torch.Tensor
    ) -> tuple[np.ndarray, torch.Tensor]:
        """A parent whose prompt is now computed forks its other samples: they share its blocks,
        take rows of their own and sample their first token from its logits row. Returns every
        sampling row (rows, then the new ones) and their logits."""
        batch = self.batch
        new_rows: list[int] = []
        parent_at: list[int] = []
        for i in np.flatnonzero(batch.forking[rows]).tolist():
            parent = batch.seq_at(int(rows[i]))
            for index in parent.pending_forks:
                child = self.factory.make(parent.request, index)
                self.kv_manager.fork(parent, child)
                self.scheduler.add_forked(child)
                new_rows.append(child.row)
                parent_at.append(i)
            parent.pending_forks = []
            batch.forking[parent.row] = False
        at = np.concatenate([np.arange(len(rows)), np.array(parent_at, dtype=np.int64)])
        rows = np.concatenate([rows, np.array(new_rows, dtype=np.int64)])
        return rows, logits.index_select(0, torch.from_numpy(at).to(logits.device))

    def _sample(self, inputs: StepInputs, logits: torch.Tensor) -> list[Sequence]:
        """Sample the rows whose sequences computed all their tokens, append the tokens to the
        batch, and return the sequences the stop checks end. Plain greedy rows take their
        argmax with no Python per row; only rows whose flags need it are read as sequences."""
        parts, clock = self.stats.step_time_s, time.perf_counter
        t0 = clock()
        batch, rows = self.batch, inputs.sample_rows
        finished: list[Sequence] = []
        beam = batch.beam[rows]
        if beam.any():  # the beams' rows go to their searches, the others are sampled
            finished, rows, logits = self._advance_beams(rows, logits, beam)
            if not len(rows):
                parts["sample"] += clock() - t0
                return finished
        if batch.forking[rows].any():
            rows, logits = self._fork_samples(rows, logits)
        forced = self._forced_tokens(rows)
        if not forced and batch.plain_greedy[rows].all():
            result = sample_greedy(logits, self.argmax)
        else:
            result = self._sample_rows(rows, logits, forced)
        batch.append_tokens(rows, result.token_ids)
        t1 = clock()
        parts["sample"] += t1 - t0
        return finished + self._append(rows, result, t1)

    def _advance_beams(
        self, rows: np.ndarray, logits: torch.Tensor, beam: np.ndarray
    ) -> tuple[list[Sequence], np.ndarray, torch.Tensor]:
        """One step of every beam search in the step (beam_steps.py); returns its finished results,
        and the batch rows and logits of the other rows, which sample."""
        at = torch.from_numpy(np.flatnonzero(beam)).to(logits.device)
        beams = self.batch.seqs(rows[beam])
        finished = self.beams.advance(beams, logits.index_select(0, at), self.stats)
        keep = ~beam
        at = torch.from_numpy(np.flatnonzero(keep)).to(logits.device)
        return finished, rows[keep], logits.index_select(0, at)

    def _forced_tokens(self, rows: np.ndarray) -> dict[int, int]:
        """Row -> the token it must take: the end of thinking of rows past their budget."""
        if self.reasoning is None:
            return {}
        forced = {}
        for row, seq in enumerate(self.batch.seqs(rows)):
            thinking = seq.feature(ThinkingTracker)
            if thinking is not None and (token := thinking.forced_token) is not None:
                forced[row] = token
        return forced

    def _sample_rows(
        self, rows: np.ndarray, logits: torch.Tensor, forced: dict[int, int]
    ) -> SamplerOutput:
        """Sample the batch rows `rows` (logits in their order), not all plain greedy: settings
        and draw keys from the batch's columns; sequences are read only for the rows that carry
        lists (penalties' token histories, grammars and their thinking)."""
        batch, n = self.batch, len(rows)
        params = batch.sampling.take(rows)
        keys = draw_keys(batch.seed[rows], batch.num_tokens[rows])
        processed = np.flatnonzero(params.processed).tolist()
        penalties = None
        if processed:
            seqs = batch.seqs(rows[processed])
            penalties = Penalties(
                processed,
                [s.params for s in seqs],
                [s.token_ids[: s.num_prompt_tokens] for s in seqs],
                [s.output_token_ids for s in seqs],
                [self.eos_ids] * len(seqs),
            )
        constrained = np.flatnonzero(batch.constrained[rows]).tolist()
        constraints: list[Constraint | None] = [None] * n
        thinking: dict[int, ThinkingTracker] = {}
        token_mask = None
        if constrained:
            for i, seq in zip(constrained, batch.seqs(rows[constrained]), strict=True):
                tracker = seq.feature(ThinkingTracker)
                if tracker is not None:
                    thinking[i] = tracker
                constraints[i] = _active_constraint(seq, tracker)
            token_mask = self.masks.fill(constraints)
            if token_mask is not None and self.reasoning is not None:
                before = [i for i in token_mask.rows if (t := thinking.get(i)) and t.may_open]
                allow_start_marker(token_mask, before, self.reasoning.start_id)
        if forced:
            token_mask = force_tokens(token_mask, forced, n, self.masks.vocab_size)
        result = sample(logits, params, keys, penalties, token_mask, self.argmax, self.race)
        if not constrained:
            return result
        # A grammar takes answer tokens, not a start marker.
        for i, tracker in thinking.items():
            if constraints[i] is not None and not tracker.is_answer_token(result.token_ids[i]):
                constraints[i] = None
        advance(constraints, result.token_ids)
        return result

    def _append(self, rows: np.ndarray, result: SamplerOutput, t1: float) -> list[Sequence]:
        """The stop checks of the rows that just took result's tokens (in the batch already):
        Python only for the rows whose token needs it (InputBatch.rows_to_check); returns the
        sequences that finish."""
        self.stats.generated_tokens += len(rows)
        batch = self.batch
        check = batch.rows_to_check(rows, result.token_ids)
        finished = []
        if check:
            logprobs = result.logprobs
            for i, seq in zip(check, batch.seqs(rows[check]), strict=True):
                if self._check(seq, logprobs[i]):
                    finished.append(seq)
        self.stats.step_time_s["stop_checks"] += time.perf_counter() - t1
        return finished

    def _check(self, seq: Sequence, logprobs: TopLogprobs | None) -> bool:
        """The Python side of a sequence's new token (see InputBatch.rows_to_check): first-token
        stats, logprobs, thinking and the stop checks; True when it finishes (its row and
        blocks are given back)."""
        tokens = seq.token_ids
        token = tokens[-1]
        if len(tokens) == seq.num_prompt_tokens + 1 and seq.request.index not in self._started:
            self._started.add(seq.request.index)
            self.stats.record_first_token()
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
        if logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(logprobs)
        thinking, stop = seq.feature(ThinkingTracker), seq.stop
        if thinking is not None and thinking.append(token) and not stop.text_open:
            stop.open_text(tokens[-5:-1])  # the answer begins with this token
        decision = stop.catch_up(tokens)
        constraint = seq.feature(Constraint)
        if (decision is not None or constraint is not None) and self._stops(
            seq, constraint, decision
        ):
            self.scheduler.finish(seq)
            return True
        return False

    @staticmethod
    def _stops(seq: Sequence, constraint: Constraint | None, decision: StopDecision | None) -> bool:
        """After the stop checker's decision on the new token, a structured output's stop
        strings; when the sequence ends, set its finish reason and final text."""
        text = None
        if (
            constraint is not None
            and constraint.has_stops
            and (decision is None or decision.finish_reason == "length")
        ):
            text = seq.stop.text
            hit = constraint.find_stop(text)
            if hit is not None:  # a stop string where the grammar is complete
                decision, text = StopDecision("stop", hit.stop), text[: hit.end]
        if decision is None:
            return False
        seq.finish_reason, seq.stop_reason = decision.finish_reason, decision.stop_reason
        seq.text = seq.stop.text if text is None else text
        return True


def _pool_total(seq: Sequence) -> torch.Tensor | None:
    pool_sum = seq.feature(PoolSum)
    return None if pool_sum is None else pool_sum.total


def _active_constraint(seq: Sequence, thinking: ThinkingTracker | None) -> Constraint | None:
    """The constraint that masks seq's next token: none while it thinks."""
    if thinking is not None and not thinking.answer_may_start:
        return None
    return seq.feature(Constraint)


def _token_ids(tokenizer: Tokenizer, tokens: list[str]) -> list[int]:
    """Each text's token id; ValueError naming a text that is not exactly one token."""
    ids = [tokenizer.single_token_id(t) for t in tokens]
    bad = [t for t, i in zip(tokens, ids, strict=True) if i is None]
    if bad:
        raise ValueError(
            f"classifier_from_token: {bad} are not single tokens of this model's vocabulary: "
            "give tokens as the tokenizer spells them"
        )
    return [i for i in ids if i is not None]
