"""Speculative decoding's drafts, step by step (EngineConfig.speculative_config).

After each step's commit, the drafter (batchpage/speculative: n-gram prompt lookup or suffix
decoding) follows the tokens the speculating rows took, a cost model decides how many drafts
each decode row should run (speculative/budget.py: the step's cost against its tokens, fitted
over the engine's steps, and each row's running acceptance, kept in the batch's columns and
starting from the engine's over all rows: DraftStage.prior), and
the drafter fills the batch's `drafts` / `num_drafts` columns. The scheduler schedules a row's
drafts with its newest token (one short prefill chunk over the paged KV), the step builder feeds
them, the sampler draws every position as it would without speculation and verification keeps
the drafts the draws confirm (speculative/verify.py); the commit takes the accepted tokens and
gives back the computed count of the rejected ones.

A row speculates (InputBatch.speculates, set when it joins) when its tokens depend on nothing
a draft would have to be checked against one by one: no penalties, logit bias or min_tokens (the
token history), no thinking budget, no beam search. A grammar row's drafts are cut at the first
its grammar rejects, and the sampler masks each of its positions by the grammar after the drafts
before it. A row's drafts never take it past
its length limit or max_model_len. While the cost model drafts nothing (a large batch on a CPU)
the drafter stops following rows after a while, so it costs nothing per row; rows are started
again (with all their tokens) when drafts pay again.

The drafter follows rows through the batch's seq_id column and takes each step's calls over
arrays of rows (Drafter.append_many, propose_many): with a columnar drafter (ngram.py) a step
runs no Python per row (tests/engine/test_decode_step_work.py); Python runs only for a row
started (new, or admitted again after a preemption) and for a grammar row's drafts.
"""

from __future__ import annotations

import numpy as np

from batchpage.engine.commit import StepResult
from batchpage.engine.constraint import Constraint
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.sequence import Sequence
from batchpage.speculative.budget import StepCostFit, draft_counts
from batchpage.speculative.config import SpeculativeConfig, build_drafter

# Steps with no draft at all before the drafter lets go of its rows: a batch that shrinks
# below the point where drafts pay (a job's last rows) takes them up again.
_IDLE_STEPS = 16
# Each step's acceptance counts weigh this much against the row's earlier ones.
_DECAY = 0.8
# The same for the engine's counts over all rows (the prior of a row that joins), which follow
# the job's acceptance more slowly than a row follows its own.
_ENGINE_DECAY = 0.98
# How many drafted tokens the engine's acceptance weighs as in a row's odds: a row's own counts
# outweigh it after a step or two of drafts.
_PRIOR_WEIGHT = 2.0


class DraftStage:
    """The drafter of one engine, fed from the batch after each commit."""

    def __init__(self, config: SpeculativeConfig, batch: InputBatch, max_model_len: int) -> None:
        self.config = config
        self.batch = batch
        self.max_model_len = max_model_len
        self.cost = StepCostFit()
        self.drafter = build_drafter(config)
        self._following: set[int] = set()  # seq ids the drafter has started
        # Per row, the id of the sequence the drafter follows there as of its last (re)start
        # (-1: none). A row is followed while it holds that sequence: one comparison with the
        # batch's seq_id column, so a step's follow and propose loop over no rows. A sequence
        # preempted and admitted again elsewhere is started again there with all its tokens.
        self._row_key = np.full(batch.capacity, -1, dtype=np.int64)
        self._idle = 0  # steps in a row that drafted nothing
        # The engine's drafted tokens accepted and tried, decayed, over every row (see `prior`).
        self._hits = 0.0
        self._tries = 0.0

    def reset(self) -> None:
        """A new run: any row still followed is let go. What the drafter learned from finished
        sequences stays: a job's windows are runs, and a suffix drafter's cache of outputs is
        the job's (bounded by its own limits)."""
        self._let_go()
        self._idle = 0

    def _let_go(self) -> None:
        """Stop following every row (the drafter frees their state, learning nothing)."""
        for key in self._following:
            self.drafter.drop(key)
        self._following = set()
        self._row_key[:] = -1

    def _followed(self, rows: np.ndarray) -> np.ndarray:
        """bool [len(rows)]: whether the drafter follows the sequence each row holds."""
        ids = self.batch.seq_id[rows]
        return (self._row_key[rows] == ids) & (ids >= 0)

    def follow(
        self,
        result: StepResult,
        finished: list[Sequence],
        tokens: int,
        sampled: int,
        seconds: float,
    ) -> None:
        """After a step's commit: the cost model takes the step (`tokens` run and `sampled`
        positions sampled in `seconds`),
        the rows that ran drafts update their acceptance, finished sequences end, and each
        followed row that took tokens is extended by them."""
        self.cost.observe(tokens, sampled, seconds)
        drafter, following, batch = self.drafter, self._following, self.batch
        for seq in finished:
            if seq.seq_id in following:
                following.discard(seq.seq_id)
                drafter.finish(seq.seq_id, seq.token_ids)
            else:  # not followed (drafts did not pay): a suffix drafter caches it all the same
                drafter.learn(seq.output_token_ids)
        rows, counts = result.rows, result.counts
        ran = batch.num_drafts[rows]  # a finished row's is zero
        drafted = np.flatnonzero(ran)
        if len(drafted):
            at, accepted = rows[drafted], counts[drafted] - 1
            tried = np.minimum(accepted + 1, ran[drafted])  # up to the first rejected one
            batch.draft_hits[at] = _DECAY * batch.draft_hits[at] + accepted
            batch.draft_tries[at] = _DECAY * batch.draft_tries[at] + tried
            self._hits = _ENGINE_DECAY * self._hits + float(accepted.sum())
            self._tries = _ENGINE_DECAY * self._tries + float(tried.sum())
        if not following:
            return
        # A row that finished in the step is free (seq_id -1), so not followed.
        live = np.flatnonzero(self._followed(rows))
        drafter.append_many(batch.seq_id[rows[live]], result.tokens[live], counts[live])

    def propose(self, num_running: int) -> None:
        """Each decode row that speculates gets the drafts the cost model finds worth running
        next step (none above the config's disable_by_batch_size running rows)."""
        batch = self.batch
        batch.num_drafts[:] = 0
        limit = self.config.disable_by_batch_size
        rows = np.flatnonzero(batch.speculates & (batch.computed == batch.num_tokens - 1))
        if (limit is not None and num_running > limit) or not len(rows):
            return self._idle_step()
        n = batch.num_tokens[rows]
        cap = np.minimum(batch.stop_len[rows] - n - 1, self.max_model_len - n)
        cap = np.clip(cap, 0, self.config.num_speculative_tokens)
        if self.cost.ready:
            w = _PRIOR_WEIGHT
            alpha = (batch.draft_hits[rows] + w * self.prior) / (batch.draft_tries[rows] + w)
            k = draft_counts(alpha, cap, num_running, *self.cost.coefficients())
        else:  # drafting in full meanwhile varies the steps' token counts the fit needs
            k = cap
        take = np.flatnonzero(k)
        if not len(take):
            return self._idle_step()
        self._idle = 0
        rows, k = rows[take], k[take]
        new = rows[~self._followed(rows)]
        for seq in batch.seqs(new):  # new, restarted after preemption, or dropped while idle
            self._following.add(seq.seq_id)
            self.drafter.start(seq.seq_id, seq.token_ids, seq.num_prompt_tokens)
        self._row_key[new] = batch.seq_id[new]
        drafts, counts = self.drafter.propose_many(batch.seq_id[rows], k)
        for i in np.flatnonzero(batch.constrained[rows]).tolist():
            # A grammar row runs its drafts up to the first its grammar rejects.
            constraint = batch.seq_at(int(rows[i])).feature(Constraint)
            assert constraint is not None, "a constrained row's sequence has its grammar"
            counts[i] = constraint.valid_prefix(drafts[i, : counts[i]])
        batch.drafts[rows, : drafts.shape[1]] = drafts
        batch.num_drafts[rows] = counts

    @property
    def prior(self) -> float:
        """The odds a row's next draft is accepted before its own drafts say: the engine's
        acceptance over its rows' drafts so far, optimistic (1) before any. A fixed middle
        prior would keep every row from its first draft wherever a step's cost asks for better
        odds than that (16 running on a CPU, a 1B model), so the job would never learn that its
        drafts are right; an optimistic one costs a step of drafts at most before the job's
        own acceptance takes over."""
        return (self._hits + 1.0) / (self._tries + 1.0)

    def _idle_step(self) -> None:
        self._idle += 1
        if self._idle >= _IDLE_STEPS and self._following:
            # Let go of every row: nothing per row while drafts do not pay. What a suffix
            # drafter learned from finished rows stays; the rows let go teach it nothing.
            self._let_go()
