"""Scheduler: decides, each step, which sequences run and how many of their tokens.

Continuous batching with one token budget per step (max_num_batched_tokens):
1. Running sequences first, oldest admission first: a decode takes one token, an unfinished
   prefill takes the next chunk that fits the budget. When blocks run out, the most recently
   admitted sequence is preempted: with "recompute" its blocks go back (its computed full blocks
   stay in the prefix cache) and it later prefills its prompt and what it generated so far; with
   "swap" its K/V is copied to host memory first and copied back when it is readmitted.
2. Then waiting sequences are admitted in queue order while the budget, max_num_seqs and free
   blocks allow, the free blocks counting what the running sequences are expected to still need
   (admission.py: admitting on the prompt alone fills the pool with sequences that then all grow
   and preempt each other). Each first borrows its longest cached prefix from the KV cache
   manager and computes only the rest. A prompt larger than the budget is prefilled in chunks
   over several steps, in the same forward as the running decodes. A sequence that shares an
   uncached block with one admitted in the same step waits one step, so that block is computed
   once and shared; the sequences queued behind it are still admitted (a step full of short
   prompts behind a shared system prompt needs them), and it keeps its place at the queue's
   head.
Beam searches (beam_steps.py) run in the same steps: their sequences stay ahead of the others in the
running set, a group's beams are scheduled together or not at all (they advance in lockstep),
they are never preempted, and a group is admitted only when every group's worst case fits the
pool together.
LoRA adapters (engine/adapter_slots.py): a sequence is admitted only when its adapter is resident
or a slot is idle, so the running set never needs more than max_loras adapters; a load it causes
goes out with the step. Rows of one adapter share cached prefixes only among themselves
(kv_manager.py), and the prefix order groups a batch by adapter first.
The scheduler owns the queues and the running set's input batch (input_batch.py: a sequence
joins it when admitted and leaves when it finishes or is preempted); the KVCacheManager owns the
blocks. Its decision each step is a SchedulerOutput (schedule_output.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from itertools import groupby, islice

import numpy as np

from batchpage.cache.block_pool import OutOfBlocks
from batchpage.engine.adapter_slots import AdapterSlots
from batchpage.engine.admission import Demand, GrowthEstimate, OutputLimits
from batchpage.engine.beam_group import worst_case_blocks
from batchpage.engine.config import EngineConfig
from batchpage.engine.image_budget import ImageBudget, holds_nothing
from batchpage.engine.image_spans import whole_spans
from batchpage.engine.input_batch import InputBatch
from batchpage.engine.kv_manager import (
    KVCacheManager,
    StaticKVCacheManager,
    blocks_for,
    tree_key,
)
from batchpage.engine.schedule_output import Picks, SchedulerOutput, Swap
from batchpage.engine.sequence import PendingForks, SeqStatus, Sequence

# The waiting heads whose futures one numpy call computes: a step's token budget often stops
# admission long before every free row is taken, and the rest would be computed for nothing.
_FUTURES_AT_ONCE = 32


class Admit(Enum):
    """What admission made of a waiting sequence this step."""

    ADMITTED = "admitted"
    WAITS = "waits"  # it shares an uncomputed block with one admitted this step
    NO_ROOM = "no room"  # the budget or the pool: nothing behind it goes either


@dataclass(frozen=True)
class SwappedOut:
    """Attached to a sequence preempted by a swap-out (preemption_mode "swap") until it is
    readmitted: the K/V of its first `tokens` tokens waits in host memory."""

    tokens: int


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        schedule: str = "prefix",
        max_model_len: int | None = None,
        growth: GrowthEstimate | None = None,
        adapters: AdapterSlots | None = None,
        max_drafts: int = 0,
        encoder_holds: Callable[[bytes], bool] = holds_nothing,
        whole_image_spans: bool = False,
    ) -> None:
        """With `growth` (and max_model_len, which bounds a sequence's budget), admission keeps
        room for the growth it expects; without, a sequence is admitted when its prompt fits.
        `adapters`: the LoRA slots (None: no LoRA request may come). `max_drafts`: speculative
        decoding's drafts a row may run after its newest token (engine/drafts.py; 0: off).
        `encoder_holds`: whether the encoder cache holds an image's rows (image_budget.py: the
        tower's work a step starts is budgeted like its tokens). `whole_image_spans`: the
        model's image rows attend both ways, so no prompt chunk ends inside an image's span
        (image_spans.py)."""
        if growth is not None and max_model_len is None:
            raise ValueError("admission by expected growth needs max_model_len")
        self.kv = kv
        self.max_model_len = max_model_len
        self.growth = growth
        self.adapters = adapters if adapters is not None else AdapterSlots(0)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.schedule_order = schedule
        self.waiting: deque[Sequence] = deque()
        # The running sequences, each holding a row of the batch: beam-search sequences first
        # (num_beams of them, each group's beams together), then the others in admission
        # order; `_rows` holds their rows in the same order.
        max_len = max_model_len if max_model_len is not None else kv.num_blocks * kv.block_size
        self.batch = InputBatch(
            max_num_seqs, blocks_for(max_len, kv.block_size), self.adapters, max_drafts
        )
        self.running: list[Sequence] = []
        self._rows: list[int] = []
        self.num_beams = 0
        self.num_preemptions = 0
        self.num_swaps = 0
        self.images = ImageBudget(max_num_batched_tokens, encoder_holds)
        self.whole_image_spans = whole_image_spans

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_batch(self, seqs: list[Sequence]) -> None:
        """Queue a batch. With schedule="prefix" the batch is queued in the prefix cache's key
        order (kv_manager.tree_key: the tokens, an image's positions its content key): prompts
        that share a prefix run back to back (depth-first over the prompts' trie), so their
        shared blocks are computed once and are still cached when the next one arrives, and
        prompts about the same picture run together. The order of results is the caller's
        business."""
        if self.schedule_order == "prefix":
            seqs = sorted(seqs, key=lambda s: (_adapter_id(s), tree_key(s, s.num_tokens)))
        self.waiting.extend(seqs)

    def add_forked(self, child: Sequence) -> None:
        """A sample forked from a running sequence runs from the next step on."""
        self.adapters.take(child.request.lora)  # resident: its parent runs it
        self._start(child, len(self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _start(self, seq: Sequence, at: int) -> None:
        """seq runs from now on, at position `at` of the running set, in a row of the batch."""
        seq.status = SeqStatus.RUNNING
        row = self.batch.join(seq)
        self.running.insert(at, seq)
        self._rows.insert(at, row)

    def _stop(self, at: int, status: SeqStatus) -> Sequence:
        """The sequence at position `at` of the running set leaves it and its row."""
        seq = self.running.pop(at)
        del self._rows[at]
        self.batch.leave(seq)
        seq.status = status
        self.adapters.give_back(seq.request.lora)
        return seq

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.batch)
        picks = Picks()
        self.images.new_step()
        budget = self._schedule_beams(out, picks)
        budget = self._schedule_running(out, picks, budget)

        # Admitting while preempting would only thrash: the pool is already short this step. But
        # when preemption left nothing to run, the queue's head (perhaps the victim) goes next.
        # The running sequences' demand is computed at the first admission that needs it: a
        # step that admits nothing (a full batch, an empty queue) does not walk them.
        demand: Demand | None = None
        admitted: list[Sequence] = []
        deferred: list[Sequence] = []  # waiting a step for a block one admitted now computes
        futures = self._head_futures(min(_FUTURES_AT_ONCE, self.max_num_seqs - len(self.running)))
        while (not out.preempted or picks.empty) and self.waiting:
            if budget <= 0:
                break
            seq = self.waiting[0]
            # Samples forked from seq after its prefill count against max_num_seqs now.
            if len(self.running) + _copies(seq) > self.max_num_seqs:
                break
            future = next(futures)
            beam = seq.params.use_beam_search
            if beam and not self._beam_fits(seq):
                break
            if not self.adapters.can_take(seq.request.lora):
                break
            swapped = seq.feature(SwappedOut)
            if swapped is not None:
                chunk = self._swap_in(seq, swapped.tokens, budget, out)
                if chunk is None:
                    break
            else:
                if demand is None:
                    demand = self._demand()
                verdict, chunk = self._admit(seq, budget, demand, future, admitted, out)
                if verdict is Admit.WAITS:
                    deferred.append(self.waiting.popleft())
                    continue
                if verdict is Admit.NO_ROOM:
                    break
            if demand is not None and future is not None:
                demand.add(*future, copies=_copies(seq), held=len(seq.block_table))
            self.waiting.popleft()
            load = self.adapters.take(seq.request.lora)
            if load is not None:
                assert seq.request.lora is not None
                out.lora_loads.append((load, seq.request.lora))
            if beam:
                self._start(seq, self.num_beams)
                self.num_beams += 1
            else:
                self._start(seq, len(self.running))
            picks.one(seq.row, chunk)
            admitted.append(seq)
            budget -= chunk
        self.waiting.extendleft(reversed(deferred))
        if self.growth is not None:
            self.growth.stepped(preempted=bool(out.preempted))
        picks.done(out)
        self.batch.refresh_tables(self.kv.take_changed())
        return out

    def _schedule_running(self, out: SchedulerOutput, picks: Picks, budget: int) -> int:
        """Schedule the running sequences that are not beams, in admission order, each its next
        tokens (a decode one, a prefill the next chunk) while the budget lasts; returns the
        budget left. Decided from the batch's columns: only the rows whose next tokens do not
        fit in blocks they own alone go to the KV manager one by one, and when it is out of
        blocks the most recently admitted sequence is preempted until they fit."""
        start = self.num_beams
        if len(self.running) == start or budget <= 0:
            return budget
        batch, bs = self.batch, self.kv.block_size
        rows = np.array(self._rows[start:], dtype=np.int64)
        take = batch.num_tokens[rows] - batch.computed[rows]
        drafts = batch.num_drafts[rows]
        if drafts.any():
            # A decode row with drafts (speculative decoding) runs them after its newest token,
            # in what the budget leaves once every row has its own tokens: drafts never push a
            # row's newest token out of the step.
            room = max(budget - int(take.sum()), 0)
            before = np.cumsum(drafts) - drafts
            take = take + np.clip(room - before, 0, drafts)
        served = np.cumsum(take)
        count = int(np.searchsorted(served, budget, side="right"))  # served whole
        if count < len(rows):
            left = budget - (int(served[count - 1]) if count else 0)
            if left > 0:  # the next one gets what is left
                take[count] = left
                count += 1
        rows, take = rows[:count], take[:count]
        # Prompt chunks over images: the vision tower's work is budgeted too (image_budget.py).
        imaged = np.flatnonzero(
            batch.has_images[rows] & (batch.computed[rows] < batch.num_prompt[rows])
        )
        for i in imaged.tolist():
            seq = self.running[start + i]
            done = int(batch.computed[rows[i]])
            take[i] = self._spans(seq, done, self.images.cut(seq, done, int(take[i])))
        short = batch.computed[rows] + take > batch.table_len[rows] * bs
        tails = self.kv.shared_tails()
        if tails:  # forked sequences whose partly filled last block may be shared
            short |= np.isin(rows, [s.row for s in tails if s.batch is batch])
        for i in np.flatnonzero(short).tolist():
            if i >= count:
                break
            seq = self.running[start + i]
            while True:
                try:
                    out.copies += self.kv.allocate(seq, int(take[i]))
                    break
                except OutOfBlocks:  # allocate changed nothing: make room and try again
                    victim = self._preempt(out)
                    count = min(count, len(self.running) - start)
                    if victim is seq:
                        break
        if count:
            run = np.flatnonzero(take[:count])  # a row cut to nothing before an image waits
            picks.many(rows[run], take[run])
        return budget - int(take[:count].sum())

    def _schedule_beams(self, out: SchedulerOutput, picks: Picks) -> int:
        """Schedule the beam searches' sequences, each group whole or not at all (a group whose
        beams do not all fit what is left of the budget waits a step); returns the budget left.
        A beam short of a block takes it from the most recently admitted other sequence."""
        budget = self.max_num_batched_tokens
        running, i = self.running, 0
        while i < self.num_beams and budget > 0:
            req = running[i].request
            end = i + 1
            while end < self.num_beams and running[end].request is req:
                end += 1
            group, i = running[i:end], end
            need = [
                self._spans(s, s.num_computed_tokens, min(s.num_uncomputed_tokens, budget))
                for s in group
            ]
            # A search's prompt (a group of one) may pass the budget only to finish an image
            # span (image_spans.whole_spans), as any prompt chunk may.
            if sum(need) > budget and len(group) > 1:
                continue
            for seq, n in zip(group, need, strict=True):
                while True:
                    try:
                        out.copies += self.kv.allocate(seq, n)
                        break
                    except OutOfBlocks:
                        if len(running) == self.num_beams:
                            raise RuntimeError(
                                "beam searches hold every block: admission reserves their worst "
                                "case, so this is a bug"
                            ) from None
                        self._preempt(out)
                picks.one(seq.row, n)
                budget -= n
        return budget

    def _beam_fits(self, seq: Sequence) -> bool:
        """Whether the worst case of seq's beam search fits the pool beside the worst cases of
        those running (beams are never preempted, so each group keeps room for all of its
        beams at their longest)."""
        assert self.max_model_len is not None, "beam search needs max_model_len"
        groups = {s.request: s.num_prompt_tokens for s in self.running[: self.num_beams]}
        groups[seq.request] = seq.num_prompt_tokens
        size = self.kv.block_size
        need = sum(
            worst_case_blocks(r.params, n, self.max_model_len, size) for r, n in groups.items()
        )
        return need <= self.kv.num_blocks

    def replace(self, old: list[Sequence], new: list[Sequence]) -> None:
        """A beam group's next beams (forked from `old`, which hold their blocks until now) take
        the place of `old`, which leave; old's computed blocks go to the prefix cache."""
        at = self.running.index(old[0])
        assert self.running[at : at + len(old)] == old, "a group's beams run side by side"
        for seq in new:
            self.adapters.take(seq.request.lora)  # resident: old beams run it
        for _ in old:
            seq = self._stop(at, SeqStatus.FINISHED)
            self.kv.free(seq)
        for i, seq in enumerate(new):
            self._start(seq, at + i)
        self.num_beams += len(new) - len(old)

    def retire(self, beams: list[Sequence]) -> None:
        """A finished beam group's beams leave the running set; their blocks go back."""
        self.replace(beams, [])

    def _head_futures(self, n: int) -> Iterator[tuple[int, int] | None]:
        """The future (`_futures`) of the waiting queue's head at each pass of the admission
        loop, computed n sequences at a time: every pass takes the head off the queue (admitted
        or deferred) or ends the loop, so the k-th future yielded is the k-th pass's head's."""
        while chunk := list(islice(self.waiting, max(1, n))):
            yield from self._futures(chunk)

    def _futures(self, seqs: list[Sequence]) -> list[tuple[int, int] | None]:
        """Each sequence's (tokens it takes slots for now, tokens it is expected to append),
        computed at once; None each without admission by growth."""
        if self.growth is None or not seqs:
            return [None] * len(seqs)
        assert self.max_model_len is not None
        now = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        to_come = self.growth.expected_tokens(now, OutputLimits.of(seqs), self.max_model_len)
        return list(zip(now.tolist(), to_come.tolist(), strict=True))

    def _demand(self) -> Demand | None:
        """The running sequences' future, against which admission is checked (admission.py);
        each sample still to fork grows on its own. None: admission on the prompt alone."""
        if self.growth is None:
            return None
        assert self.max_model_len is not None
        batch = self.batch
        rows = np.array(self._rows, dtype=np.int64)
        copies = np.ones(len(rows), dtype=np.int64)
        for i in np.flatnonzero(batch.forking[rows]).tolist():
            copies[i] = _copies(self.running[i])
        now = batch.num_tokens[rows]
        limits = batch.limits.take(rows)
        to_come = self.growth.expected_tokens(now, limits, self.max_model_len)
        demand = Demand(self.kv.block_size)
        demand.add_all(now.repeat(copies), to_come.repeat(copies), held=batch.held()[1])
        return demand

    def _fits(self, seq: Sequence, demand: Demand | None, future: tuple[int, int] | None) -> bool:
        """Whether the peak of what the running sequences and seq will hold together fits in
        what they hold now plus the free blocks. With nothing running, seq goes in whatever it
        may grow to: the job must progress."""
        if demand is None or future is None or not self.running:
            return True
        return demand.fits(future, demand.held + len(seq.block_table) + self.kv.num_free_blocks)

    def _admit(
        self,
        seq: Sequence,
        budget: int,
        demand: Demand | None,
        future: tuple[int, int] | None,
        admitted: list[Sequence],
        out: SchedulerOutput,
    ) -> tuple[Admit, int]:
        """`future`: seq's (tokens now, tokens expected to come), None without admission by
        growth. Returns the verdict and, when admitted, the tokens seq computes this step."""
        cached = self.kv.lend_prefix(seq)
        n = seq.num_uncomputed_tokens
        chunk = min(n, budget)
        if seq.request.images:  # the vision tower's work is budgeted too (image_budget.py)
            chunk = self._spans(
                seq, seq.num_computed_tokens, self.images.cut(seq, seq.num_computed_tokens, chunk)
            )
        verdict = Admit.ADMITTED
        if self._waits_for_shared_prefix(seq, admitted):
            verdict = Admit.WAITS
        elif (
            chunk == 0
            or (n > budget and not self.enable_chunked_prefill)
            or not self.kv.can_allocate(seq, chunk)
            or not self._fits(seq, demand, future)
        ):
            verdict = Admit.NO_ROOM
        if verdict is not Admit.ADMITTED:
            self.kv.free(seq, cache=False)  # give the lent prefix back; it stays queued
            seq.num_computed_tokens = 0
            return verdict, 0
        if seq.status is SeqStatus.WAITING:  # its first admission (not a preempted one's)
            seq.num_cached_tokens = cached
        out.copies += self.kv.allocate(seq, chunk)
        return verdict, chunk

    def _spans(self, seq: Sequence, start: int, take: int) -> int:
        """take, moved so that the chunk ends outside every image span when the model needs
        spans whole (image_spans.whole_spans); as is otherwise."""
        if not self.whole_image_spans or not seq.request.images:
            return take
        return whole_spans(seq, start, take)

    def _swap_in(self, seq: Sequence, saved: int, budget: int, out: SchedulerOutput) -> int | None:
        """Readmit a swapped-out sequence: fresh blocks for its `saved` tokens' K/V, then its
        next token. Returns the tokens it computes this step; None: the pool has no room for
        it."""
        n = self._spans(seq, saved, min(seq.num_tokens - saved, budget))
        if blocks_for(saved + n, self.kv.block_size) > self.kv.num_free_blocks:
            return None
        seq.num_computed_tokens = 0
        self.kv.allocate(seq, saved)
        out.swap_in.append(Swap(seq.seq_id, list(seq.block_table)))
        seq.num_computed_tokens = saved
        seq.detach(SwappedOut)
        out.copies += self.kv.allocate(seq, n)
        return n

    def _waits_for_shared_prefix(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """Whether seq shares at least one more full block with a sequence admitted this step
        than the cache gave it: computing that block once, then hitting it next step, beats
        computing it twice now."""
        # Sequences that score their prompt never borrow cached blocks: nothing to wait for.
        if self.kv.tree is None or seq.reads_every_prompt_row:
            return False
        bs = self.kv.block_size
        limit = seq.num_tokens - 1  # the cache never covers the last prompt token
        start = seq.num_computed_tokens
        for other in admitted:
            end = min(limit, other.num_tokens)
            if (
                other.request.lora == seq.request.lora
                and start + bs <= end
                and seq.token_ids[start : start + bs] == other.token_ids[start : start + bs]
                and seq.token_ids[:start] == other.token_ids[:start]
            ):
                return True
        return False

    def _preempt(self, out: SchedulerOutput) -> Sequence:
        """Preempt the most recently admitted running sequence; returns it."""
        seq = self._stop(len(self.running) - 1, SeqStatus.PREEMPTED)
        if self.preemption_mode == "swap" and seq.num_computed_tokens:
            out.swap_out.append(Swap(seq.seq_id, list(seq.block_table)))
            seq.attach(SwappedOut(seq.num_computed_tokens))
            self.num_swaps += 1
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
        return seq

    def update_from_output(self, out: SchedulerOutput, rejected: np.ndarray | None = None) -> int:
        """A step's computed tokens, committed (by engine/commit.py, for the engine's steps and
        the simulator's): each row's computed count moves on by what it ran less what it
        `rejected` (over out.rows: drafted tokens not accepted, whose K/V is overwritten later),
        in one write for the step, and a row that was prefilling publishes its computed full
        blocks to the prefix cache, so that sequences admitted later hit them while it still
        runs. Whether a row was prefilling comes from its state before the step (its prompt not
        all computed, or more than its newest token to compute: Sequence.is_prefilling), never
        from how many tokens it got. Returns the tokens computed while prefilling: prompts, and
        what preempted sequences recompute."""
        batch, rows, num_new = self.batch, out.rows, out.num_new
        computed = batch.computed[rows]
        prefilling = (computed < batch.num_prompt[rows]) | (computed < batch.num_tokens[rows] - 1)
        batch.advance(rows, num_new if rejected is None else num_new - rejected)
        if not prefilling.any():
            return 0
        if self.kv.tree is not None:
            for row in rows[prefilling].tolist():
                self.kv.cache_progress(batch.seq_at(row))
        return int(num_new[prefilling].sum())

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running set; its blocks go back at once. One
        that stopped at an accepted draft before the last keeps only the computed tokens it
        holds (its blocks go to the prefix cache with their tokens)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self._stop(self.running.index(seq), SeqStatus.FINISHED)
        self.kv.free(seq)

    def check_integrity(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        assert all(s.status is SeqStatus.RUNNING for s in self.running)
        beams = self.num_beams
        assert all(s.params.use_beam_search for s in self.running[:beams])
        assert not any(s.params.use_beam_search for s in self.running[beams:])
        groups = [s.request for s in self.running[:beams]]
        assert len(set(groups)) == len([r for r, _ in groupby(groups)]), "a group split"
        queued = (SeqStatus.WAITING, SeqStatus.PREEMPTED)
        assert all(s.status in queued and not s.block_table for s in self.waiting)
        swapped = [s for s in (*self.waiting, *self.running) if s.feature(SwappedOut) is not None]
        assert all(s.status is SeqStatus.PREEMPTED for s in swapped), "swapped out, not preempted"
        assert all(s.batch is None for s in self.waiting)
        assert self._rows == [s.row for s in self.running], "rows out of order"
        assert len(self.batch) == len(self.running)
        self.batch.check_integrity()
        self.adapters.check_integrity(s.request.lora for s in self.running)
        self.kv.check_integrity(self.running)


def _adapter_id(seq: Sequence) -> int:
    lora = seq.request.lora
    return 0 if lora is None else lora.lora_int_id


def _copies(seq: Sequence) -> int:
    """The running sequences seq becomes once its prompt is computed: its beams, or itself and
    the samples forked from it."""
    if seq.params.use_beam_search:
        return seq.params.effective_beam_width
    forks = seq.feature(PendingForks)
    return 1 if forks is None else 1 + len(forks.indices)


def build_scheduler(
    cfg: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    encoder_holds: Callable[[bytes], bool] = holds_nothing,
    whole_image_spans: bool = False,
) -> Scheduler:
    """The engine's scheduler over a KV manager of num_blocks (paged or static, as cfg says),
    admitting by expected growth: what Engine runs, and what the simulator drives.
    `encoder_holds`: the encoder cache's membership (a vision-language model's);
    `whole_image_spans`: its image rows attend both ways (image_spans.py)."""
    if cfg.kv_allocator == "static":
        kv: KVCacheManager = StaticKVCacheManager(num_blocks, cfg.block_size, max_model_len)
    else:
        kv = KVCacheManager(num_blocks, cfg.block_size, cfg.prefix_caching, cfg.eviction_policy)
    return Scheduler(
        kv,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        preemption_mode=cfg.preemption_mode,
        schedule=cfg.schedule,
        max_model_len=max_model_len,
        growth=GrowthEstimate(),
        adapters=AdapterSlots(cfg.max_loras if cfg.enable_lora else 0),
        max_drafts=cfg.num_speculative_tokens,
        encoder_holds=encoder_holds,
        whole_image_spans=whole_image_spans,
    )
