"""The one commit of a step's results: what the step computed and sampled becomes state.

A step's outcome is data (StepResult), produced by sampling, pooling and the beam searches (or by
the simulator, which samples nothing) and consumed here, in one order:
1. computed counts: each scheduled row's computed count moves on by the tokens the step ran, less
   any it rejected (drafted tokens that were not accepted), and prefilling rows publish their
   computed full blocks to the prefix cache (Scheduler.update_from_output);
2. forks: samples of an n > 1 request whose prompt is now computed join the batch, sharing its
   blocks (their first tokens were drawn from its logits row, each with its own seed);
3. beams: each beam search's next beams take their parents' place, a finished search's results
   come back;
4. tokens: every row takes its tokens, one column at a time (a row may take several when drafted
   tokens were accepted): grammars advance, the stop checks run over the batch's columns (Python
   only for the rows whose token needs it, InputBatch.rows_to_check), and a row that stops takes
   none of its later tokens;
5. pooled outputs, prompt and token logprobs, and a finished sequence's finish reason, stop
   reason and text land in the sequences' results (Sequence.result, a SeqResult); finished
   sequences leave the running set and give their blocks back (the scheduler's `finish`), and
   the run's stats count it all.
Nothing else appends a token, runs a stop check or finishes a sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from batchpage.engine.beam_steps import BeamOutcome
from batchpage.engine.constraint import Constraint, advance
from batchpage.engine.reasoning import ThinkingTracker
from batchpage.engine.sampler import TopLogprobs
from batchpage.engine.schedule_output import SchedulerOutput
from batchpage.engine.scheduler import Scheduler
from batchpage.engine.sequence import PendingForks, Sequence
from batchpage.engine.sequence_factory import SequenceFactory
from batchpage.engine.stop_checker import StopDecision
from batchpage.metrics import RunStats


@dataclass(frozen=True)
class Forks:
    """Samples forked this step: entry f is sample `indices[f]` of the request running in batch
    row `parents[f]`, whose first token is `tokens[f]` (and its logprobs, when asked for)."""

    parents: np.ndarray  # int64 [F]
    indices: list[int]
    tokens: np.ndarray  # int64 [F]
    logprobs: list[TopLogprobs | None] | None = None


@dataclass(frozen=True)
class StepResult:
    """What a step produced, for `StepCommit.commit`. Token rows are the input batch's: row
    `rows[i]` takes `tokens[i, :counts[i]]` in order (one token a row without speculation).
    `logprobs[i][j]` belongs to tokens[i, j]; None when no row asked for logprobs. `rejected`,
    over the scheduled rows (SchedulerOutput.rows), counts the computed tokens each gives back:
    None when none."""

    rows: np.ndarray  # int64 [N]
    tokens: np.ndarray  # int64 [N, K]
    counts: np.ndarray  # int64 [N], each in [1, K]
    logprobs: list[list[TopLogprobs | None]] | None = None
    rejected: np.ndarray | None = None
    forks: Forks | None = None
    beams: list[BeamOutcome] = field(default_factory=list)
    # Pooling sequences whose prompt is computed, with their outputs (pooled_states.py).
    pooled: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)
    # Prompt logprobs scored this step: each sequence's next ones, in prompt order.
    prompt_logprobs: list[tuple[Sequence, list[TopLogprobs]]] = field(default_factory=list)

    @classmethod
    def one_each(
        cls, rows: np.ndarray, tokens: list[int] | np.ndarray, **rest: object
    ) -> StepResult:
        """Each of rows takes one token."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        return cls(rows, ids, np.ones(len(rows), dtype=np.int64), **rest)  # type: ignore[arg-type]

    @classmethod
    def nothing(cls, **rest: object) -> StepResult:
        """No row takes a token (a step of prefill chunks only, or of pooling)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty.reshape(0, 1), empty, **rest)  # type: ignore[arg-type]


class StepCommit:
    """Commits the steps of one engine (or simulation) to its scheduler, batch and KV cache."""

    def __init__(self, scheduler: Scheduler, factory: SequenceFactory | None) -> None:
        """`factory` makes forked samples (None: the caller forks none)."""
        self.scheduler = scheduler
        self.factory = factory
        self._started: set[int] = set()  # requests of this run that produced a token

    def new_run(self) -> None:
        self._started = set()

    def commit(self, out: SchedulerOutput, result: StepResult, stats: RunStats) -> list[Sequence]:
        """Commit one step (see the module docstring); returns the sequences that finished in
        it (a beam search's best hypotheses, when it ends)."""
        t0 = time.perf_counter()
        blocks_used = self.scheduler.kv.pool.num_used  # as in the forward: nothing freed yet
        stats.prefill_tokens_computed += self.scheduler.update_from_output(out, result.rejected)
        rows, tokens, counts, logprobs = result.rows, result.tokens, result.counts, result.logprobs
        if result.forks is not None:
            forked = self._fork(result.forks, rows, tokens, counts, logprobs)
            rows, tokens, counts, logprobs = forked
        finished = self._advance_beams(result.beams, stats)
        finished += self._prompt_results(result, stats)
        t1 = time.perf_counter()
        stats.step_time_s["commit"] += t1 - t0
        if len(rows):
            finished += self._take_tokens(rows, tokens, counts, logprobs, stats)
        t2 = time.perf_counter()
        stats.step_time_s["stop_checks"] += t2 - t1
        computed, blocks = self.scheduler.batch.held()
        stats.record_step(
            num_running=len(self.scheduler.running),
            used_slots=computed,
            reserved_slots=blocks * self.scheduler.kv.block_size,
            blocks_used=blocks_used,
        )
        stats.step_time_s["commit"] += time.perf_counter() - t2
        return finished

    def _fork(
        self,
        forks: Forks,
        rows: np.ndarray,
        tokens: np.ndarray,
        counts: np.ndarray,
        logprobs: list[list[TopLogprobs | None]] | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[TopLogprobs | None]] | None]:
        """The forked samples join the batch (their parents' computed counts are committed, so
        they share all of their K/V); returns the token rows with theirs appended."""
        assert self.factory is not None, "a fork needs the engine's sequence factory"
        scheduler, batch = self.scheduler, self.scheduler.batch
        new_rows = []
        for parent_row, index in zip(forks.parents.tolist(), forks.indices, strict=True):
            parent = batch.seq_at(parent_row)
            child = self.factory.make(parent.request, index)
            scheduler.kv.fork(parent, child)
            scheduler.add_forked(child)
            pending = parent.feature(PendingForks)
            assert pending is not None, "a fork from a sequence with none pending"
            pending.indices.remove(index)
            if not pending.indices:
                parent.detach(PendingForks)
                batch.forking[parent_row] = False
            new_rows.append(child.row)
        k = tokens.shape[1]
        fork_tokens = np.zeros((len(new_rows), k), dtype=np.int64)
        fork_tokens[:, 0] = forks.tokens
        rows = np.concatenate([rows, np.array(new_rows, dtype=np.int64)])
        tokens = np.concatenate([tokens, fork_tokens])
        counts = np.concatenate([counts, np.ones(len(new_rows), dtype=np.int64)])
        if logprobs is not None or forks.logprobs is not None:
            own = logprobs if logprobs is not None else [[None] * int(c) for c in counts]
            theirs = forks.logprobs if forks.logprobs is not None else [None] * len(new_rows)
            logprobs = own[: len(own)] + [[lp] for lp in theirs]
        return rows, tokens, counts, logprobs

    def _advance_beams(self, outcomes: list[BeamOutcome], stats: RunStats) -> list[Sequence]:
        """Each beam search's step: its next beams (forked from their parents) replace the old,
        or a finished search's beams retire and its results come back."""
        scheduler, finished = self.scheduler, []
        for outcome in outcomes:
            if outcome.first:
                stats.record_first_token()
                stats.cached_prompt_tokens += outcome.old[0].num_cached_tokens
            if outcome.results is not None:
                scheduler.retire(outcome.old)
                for seq in outcome.results:
                    stats.generated_tokens += seq.num_output_tokens
                finished += outcome.results
                continue
            for parent, child, token in outcome.children:
                scheduler.kv.fork(parent, child)
                child.token_ids = parent.token_ids + [token]
            scheduler.replace(outcome.old, [child for _, child, _ in outcome.children])
        return finished

    def _prompt_results(self, result: StepResult, stats: RunStats) -> list[Sequence]:
        """Prompt logprobs land in their sequences' results; pooling sequences get their outputs
        and finish."""
        for seq, scored in result.prompt_logprobs:
            assert seq.result.prompt_logprobs is not None
            seq.result.prompt_logprobs += scored
        for seq, pooled in result.pooled:
            seq.result.pooled = pooled
            seq.result.finish_reason = "stop"
            stats.cached_prompt_tokens += seq.num_cached_tokens
            self.scheduler.finish(seq)
        return [seq for seq, _ in result.pooled]

    def _take_tokens(
        self,
        rows: np.ndarray,
        tokens: np.ndarray,
        counts: np.ndarray,
        logprobs: list[list[TopLogprobs | None]] | None,
        stats: RunStats,
    ) -> list[Sequence]:
        """Column by column, the rows still going take their next token; a row that stops
        takes none after it."""
        batch, finished = self.scheduler.batch, []
        live = np.arange(len(rows))
        for j in range(tokens.shape[1]):
            live = live[counts[live] > j]
            if not len(live):
                break
            at_rows, column = rows[live], tokens[live, j]
            self._advance_grammars(at_rows, column)
            batch.append_tokens(at_rows, column)
            stats.generated_tokens += len(live)
            check = batch.rows_to_check(at_rows, column)
            if not check:
                continue
            ended = []
            for i, seq in zip(check, batch.seqs(at_rows[check]), strict=True):
                entry = int(live[i])
                lp = logprobs[entry][j] if logprobs is not None else None
                if self._check(seq, lp, stats):
                    ended.append(i)
                    finished.append(seq)
            if ended:
                live = np.delete(live, ended)
        return finished

    def _advance_grammars(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Each constrained row's grammar takes its token: an answer's, not a thinking one's
        (nor a start-of-thinking marker)."""
        batch = self.scheduler.batch
        constrained = np.flatnonzero(batch.constrained[rows]).tolist()
        if not constrained:
            return
        matchers, taken = [], []
        for i, seq in zip(constrained, batch.seqs(rows[constrained]), strict=True):
            thinking = seq.feature(ThinkingTracker)
            constraint = seq.feature(Constraint)
            token = int(tokens[i])
            if constraint is None or (
                thinking is not None
                and not (thinking.answer_may_start and thinking.is_answer_token(token))
            ):
                continue
            matchers.append(constraint)
            taken.append(token)
        advance(matchers, taken)

    def _check(self, seq: Sequence, logprobs: TopLogprobs | None, stats: RunStats) -> bool:
        """The Python side of a sequence's new token (see InputBatch.rows_to_check): first-token
        stats, logprobs, thinking and the stop checks; True when it finishes (its row and
        blocks are given back)."""
        tokens = seq.token_ids
        token = tokens[-1]
        if len(tokens) == seq.num_prompt_tokens + 1 and seq.request.index not in self._started:
            self._started.add(seq.request.index)
            stats.record_first_token()
            stats.cached_prompt_tokens += seq.num_cached_tokens
        if logprobs is not None:
            out = seq.result
            if out.logprobs is None:
                out.logprobs = []
            out.logprobs.append(logprobs)
        thinking, stop = seq.feature(ThinkingTracker), seq.stop
        if thinking is not None and thinking.append(token) and not stop.text_open:
            stop.open_text(tokens[-5:-1])  # the answer begins with this token
        decision = stop.catch_up(tokens)
        constraint = seq.feature(Constraint)
        if (decision is not None or constraint is not None) and _stops(seq, constraint, decision):
            self.scheduler.finish(seq)
            return True
        return False


def _stops(seq: Sequence, constraint: Constraint | None, decision: StopDecision | None) -> bool:
    """After the stop checker's decision on the new token, a structured output's stop strings;
    when the sequence ends, set its finish reason and final text."""
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
    out = seq.result
    out.finish_reason, out.stop_reason = decision.finish_reason, decision.stop_reason
    out.text = seq.stop.text if text is None else text
    return True
