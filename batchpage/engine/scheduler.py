"""Scheduler: decides, each step, which sequences run and how many of their tokens.

Continuous batching with one token budget per step (max_num_batched_tokens):
1. Running sequences first, oldest admission first: a decode takes one token, an unfinished
   prefill takes the next chunk that fits the budget. When blocks run out, the most recently
   admitted sequence is preempted (recompute: its blocks go back, it returns to the front of the
   queue and later prefills its prompt and what it generated so far).
2. Then waiting sequences are admitted in queue order while the budget, max_num_seqs and free
   blocks allow; each first borrows its longest cached prefix from the KV cache manager and
   computes only the rest. A prompt larger than the budget is prefilled in chunks over several
   steps, in the same forward as the running decodes. A sequence that shares an uncached block
   with one admitted in the same step waits one step, so that block is computed once and shared.
The scheduler owns the queues; the KVCacheManager owns the blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchpage.cache.kv_manager import BlockCopy, KVCacheManager
from batchpage.engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """After this step all of the sequence's tokens are computed: it samples a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            out.copies += self.kv.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # Admitting while preempting would only thrash: the pool is already short this step.
        admitted: list[Sequence] = []
        while (
            not out.preempted
            and self.waiting
            and len(self.running) < self.max_num_seqs
            and budget > 0
        ):
            seq = self.waiting[0]
            cached = self.kv.lend_prefix(seq)
            n = seq.num_uncomputed_tokens
            if (
                self._waits_for_shared_prefix(seq, admitted)
                or (n > budget and not self.enable_chunked_prefill)
                or not self.kv.can_allocate(seq, min(n, budget))
            ):
                self.kv.free(seq, cache=False)  # give the lent prefix back; it stays queued
                seq.num_computed_tokens = 0
                break
            n = min(n, budget)
            self.waiting.popleft()
            if not seq.admitted_once:
                seq.num_cached_tokens = cached
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            self.running.append(seq)
            admitted.append(seq)
            out.copies += self.kv.allocate(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _waits_for_shared_prefix(self, seq: Sequence, admitted: list[Sequence]) -> bool:
        """Whether seq shares at least one more full block with a sequence admitted this step
        than the cache gave it: computing that block once, then hitting it next step, beats
        computing it twice now."""
        if self.kv.tree is None:
            return False
        bs = self.kv.block_size
        limit = seq.num_tokens - 1  # the cache never covers the last prompt token
        start = seq.num_computed_tokens
        for other in admitted:
            end = min(limit, other.num_tokens)
            if (
                start + bs <= end
                and seq.token_ids[start : start + bs] == other.token_ids[start : start + bs]
                and seq.token_ids[:start] == other.token_ids[:start]
            ):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running set; its blocks go back at once."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED

    def check_integrity(self) -> None:
        assert len(self.running) <= self.max_num_seqs
        assert all(s.status is SeqStatus.RUNNING for s in self.running)
        assert all(s.status is SeqStatus.WAITING and not s.block_table for s in self.waiting)
        self.kv.check_integrity(self.running)
