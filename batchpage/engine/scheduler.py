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
Beam searches (beams.py) run in the same steps: their sequences stay ahead of the others in the
running set, a group's beams are scheduled together or not at all (they advance in lockstep),
they are never preempted, and a group is admitted only when every group's worst case fits the
pool together.
LoRA adapters (engine/adapter_slots.py): a sequence is admitted only when its adapter is resident
or a slot is idle, so the running set never needs more than max_loras adapters; a load it causes
goes out with the step. Rows of one adapter share cached prefixes only among themselves
(kv_manager.py), and the prefix order groups a batch by adapter first.
The scheduler owns the queues; the KVCacheManager owns the blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from itertools import groupby
from typing import NamedTuple

import numpy as np

from batchpage.cache.block_pool import OutOfBlocks
from batchpage.engine.adapter_slots import AdapterSlots
from batchpage.engine.admission import Demand, GrowthEstimate
from batchpage.engine.beam_search import worst_case_blocks
from batchpage.engine.config import EngineConfig
from batchpage.engine.kv_manager import (
    BlockCopy,
    KVCacheManager,
    StaticKVCacheManager,
    blocks_for,
)
from batchpage.engine.sequence import SeqStatus, Sequence
from batchpage.lora.request import LoRARequest


class Admit(Enum):
    """What admission made of a waiting sequence this step."""

    ADMITTED = "admitted"
    WAITS = "waits"  # it shares an uncomputed block with one admitted this step
    NO_ROOM = "no room"  # the budget or the pool: nothing behind it goes either


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """After this step all of the sequence's tokens are computed: it samples a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class Swap:
    seq_id: int
    blocks: list[int]  # the sequence's blocks, in block-table order


@dataclass
class SchedulerOutput:
    """The step's decision. The runner applies swap_out, then swap_in, then copies, then runs
    the forward: a block freed by a swap-out may be reused in this very step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[Swap] = field(default_factory=list)
    swap_in: list[Swap] = field(default_factory=list)
    # Adapters to copy into their slots before the forward (slot, adapter).
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


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
    ) -> None:
        """With `growth` (and max_model_len, which bounds a sequence's budget), admission keeps
        room for the growth it expects; without, a sequence is admitted when its prompt fits.
        `adapters`: the LoRA slots (None: no LoRA request may come)."""
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
        # Beam-search sequences first (num_beams of them, each group's beams together), then
        # the others in admission order.
        self.running: list[Sequence] = []
        self.num_beams = 0
        self.num_preemptions = 0
        self.num_swaps = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_batch(self, seqs: list[Sequence]) -> None:
        """Queue a batch. With schedule="prefix" the batch is queued in token order: prompts
        that share a prefix run back to back (depth-first over the prompts' trie), so their
        shared blocks are computed once and are still cached when the next one arrives. The
        order of results is the caller's business."""
        if self.schedule_order == "prefix":
            seqs = sorted(seqs, key=lambda s: (_adapter_id(s), s.token_ids))
        self.waiting.extend(seqs)

    def add_forked(self, child: Sequence) -> None:
        """A sample forked from a running sequence runs from the next step on."""
        child.status = SeqStatus.RUNNING
        child.admitted_once = True
        self.adapters.take(child.request.lora)  # resident: its parent runs it
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_beams(out)
        i = self.num_beams
        # Locals: this loop runs once per running sequence every step.
        running, allocate, scheduled = self.running, self.kv.allocate, out.scheduled
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while True:
                try:
                    moves = allocate(seq, n)
                    if moves:
                        out.copies += moves
                    break
                except OutOfBlocks:  # allocate changed nothing: make room and try again
                    victim = running.pop()
                    self._preempt(victim, out)
                    if victim is seq:
                        break
            if seq.status is not SeqStatus.RUNNING:
                break
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: the pool is already short this step. But
        # when preemption left nothing to run, the queue's head (perhaps the victim) goes next.
        # The running sequences' demand is computed at the first admission that needs it: a
        # step that admits nothing (a full batch, an empty queue) does not walk them.
        demand: Demand | None = None
        admitted: list[Sequence] = []
        deferred: list[Sequence] = []  # waiting a step for a block one admitted now computes
        while (not out.preempted or not out.scheduled) and self.waiting and budget > 0:
            seq = self.waiting[0]
            # Samples forked from seq after its prefill count against max_num_seqs now.
            if len(self.running) + _copies(seq) > self.max_num_seqs:
                break
            future = self._future(seq) if self.growth is not None else None
            beam = seq.params.use_beam_search
            if beam and not self._beam_fits(seq):
                break
            if not self.adapters.can_take(seq.request.lora):
                break
            if seq.swapped_tokens:
                if not self._swap_in(seq, budget, out):
                    break
            else:
                if demand is None:
                    demand = self._demand(self.running)
                verdict = self._admit(seq, budget, demand, future, admitted, out)
                if verdict is Admit.WAITS:
                    deferred.append(self.waiting.popleft())
                    continue
                if verdict is Admit.NO_ROOM:
                    break
            if demand is not None and future is not None:
                demand.add(*future, copies=_copies(seq), held=len(seq.block_table))
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            load = self.adapters.take(seq.request.lora)
            if load is not None:
                assert seq.request.lora is not None
                out.lora_loads.append((load, seq.request.lora))
            if beam:
                self.running.insert(self.num_beams, seq)
                self.num_beams += 1
            else:
                self.running.append(seq)
            admitted.append(seq)
            budget -= out.scheduled[-1].num_new_tokens
        self.waiting.extendleft(reversed(deferred))
        if self.growth is not None:
            self.growth.stepped(preempted=bool(out.preempted))
        return out

    def _schedule_beams(self, out: SchedulerOutput) -> int:
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
            need = [min(s.num_uncomputed_tokens, budget) for s in group]
            if sum(need) > budget:
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
                        self._preempt(running.pop(), out)
                out.scheduled.append(ScheduledSeq(seq, n))
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
        self.running[at : at + len(old)] = new
        self.num_beams += len(new) - len(old)
        for seq in new:
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            self.adapters.take(seq.request.lora)  # resident: old beams run it
        for seq in old:
            self.kv.free(seq)
            seq.status = SeqStatus.FINISHED
            self.adapters.give_back(seq.request.lora)

    def retire(self, beams: list[Sequence]) -> None:
        """A finished beam group's beams leave the running set; their blocks go back."""
        self.replace(beams, [])

    def _future(self, seq: Sequence) -> tuple[int, int]:
        """(tokens seq takes slots for now, tokens it is expected to append)."""
        assert self.growth is not None and self.max_model_len is not None
        return seq.num_tokens, int(self.growth.expected_tokens([seq], self.max_model_len)[0])

    def _demand(self, seqs: list[Sequence]) -> Demand | None:
        """The running sequences' future, against which admission is checked (admission.py);
        each sample still to fork grows on its own. None: admission on the prompt alone."""
        if self.growth is None:
            return None
        assert self.max_model_len is not None
        demand = Demand(self.kv.block_size)
        copies = np.array([1 + len(s.pending_forks) for s in seqs], dtype=np.int64)
        now = np.array([len(s.token_ids) for s in seqs], dtype=np.int64).repeat(copies)
        to_come = self.growth.expected_tokens(seqs, self.max_model_len).repeat(copies)
        demand.add_all(now, to_come, held=sum(len(s.block_table) for s in seqs))
        return demand

    def _fits(self, seq: Sequence, demand: Demand | None, future: tuple[int, int] | None) -> bool:
        """Whether the peak of what the running sequences and seq will hold together fits in
        what they hold now plus the free blocks. With nothing running, seq goes in whatever it
        may grow to: the job must progress."""
        if demand is None or future is None or not self.running:
            return True
        held = demand.held + len(seq.block_table)
        peak = demand.peak_blocks(future)
        return peak <= held + self.kv.num_free_blocks

    def _admit(
        self,
        seq: Sequence,
        budget: int,
        demand: Demand | None,
        future: tuple[int, int] | None,
        admitted: list[Sequence],
        out: SchedulerOutput,
    ) -> Admit:
        """`future`: seq's (tokens now, tokens expected to come), None without admission by
        growth."""
        cached = self.kv.lend_prefix(seq)
        n = seq.num_uncomputed_tokens
        chunk = min(n, budget)
        verdict = Admit.ADMITTED
        if self._waits_for_shared_prefix(seq, admitted):
            verdict = Admit.WAITS
        elif (
            (n > budget and not self.enable_chunked_prefill)
            or not self.kv.can_allocate(seq, chunk)
            or not self._fits(seq, demand, future)
        ):
            verdict = Admit.NO_ROOM
        if verdict is not Admit.ADMITTED:
            self.kv.free(seq, cache=False)  # give the lent prefix back; it stays queued
            seq.num_computed_tokens = 0
            return verdict
        if not seq.admitted_once:
            seq.num_cached_tokens = cached
        out.copies += self.kv.allocate(seq, chunk)
        out.scheduled.append(ScheduledSeq(seq, chunk))
        return verdict

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Readmit a swapped-out sequence: fresh blocks for its saved K/V, then its next token."""
        n = min(seq.num_tokens - seq.swapped_tokens, budget)
        if blocks_for(seq.swapped_tokens + n, self.kv.block_size) > self.kv.num_free_blocks:
            return False
        seq.num_computed_tokens = 0
        self.kv.allocate(seq, seq.swapped_tokens)
        out.swap_in.append(Swap(seq.seq_id, list(seq.block_table)))
        seq.num_computed_tokens, seq.swapped_tokens = seq.swapped_tokens, 0
        out.copies += self.kv.allocate(seq, n)
        out.scheduled.append(ScheduledSeq(seq, n))
        return True

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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.preemption_mode == "swap" and seq.num_computed_tokens:
            out.swap_out.append(Swap(seq.seq_id, list(seq.block_table)))
            seq.swapped_tokens = seq.num_computed_tokens
            self.num_swaps += 1
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.adapters.give_back(seq.request.lora)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput) -> int:
        """The one place a step's computed tokens are committed (the engine's steps, beams
        included, and the simulator's): each row's computed count moves on, and a row that was
        prefilling publishes its computed full blocks to the prefix cache, so that sequences
        admitted later hit them while it still runs. Whether a row was prefilling comes from
        its state before the step (Sequence.is_prefilling), never from how many tokens it got.
        Returns the tokens computed while prefilling: prompts, and what preempted sequences
        recompute."""
        prefill = 0
        kv = self.kv
        for s in out.scheduled:
            seq = s.seq
            prefilling = seq.is_prefilling
            seq.num_computed_tokens += s.num_new_tokens
            if prefilling:
                prefill += s.num_new_tokens
                kv.cache_progress(seq)
        return prefill

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running set; its blocks go back at once."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        self.adapters.give_back(seq.request.lora)

    def check_integrity(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        assert all(s.status is SeqStatus.RUNNING for s in self.running)
        beams = self.num_beams
        assert all(s.params.use_beam_search for s in self.running[:beams])
        assert not any(s.params.use_beam_search for s in self.running[beams:])
        groups = [s.request for s in self.running[:beams]]
        assert len(set(groups)) == len([r for r, _ in groupby(groups)]), "a group split"
        assert all(s.status is SeqStatus.WAITING and not s.block_table for s in self.waiting)
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
    return 1 + len(seq.pending_forks)


def build_scheduler(
    cfg: EngineConfig, num_blocks: int, max_model_len: int, max_num_batched_tokens: int
) -> Scheduler:
    """The engine's scheduler over a KV manager of num_blocks (paged or static, as cfg says),
    admitting by expected growth: what Engine runs, and what the simulator drives."""
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
    )
