"""The scheduler and KV manager under random workloads, with a simulated model (no forward).

Every step the invariants are checked: the budget and max_num_seqs hold, every scheduled token
has a slot, the pool's references equal what the running sequences hold. At the end every
sequence has its full output and every block is free.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage.engine.admission import GrowthEstimate
from batchpage.engine.kv_manager import KVCacheManager, blocks_for
from batchpage.engine.schedule_output import SchedulerOutput
from batchpage.engine.scheduler import Scheduler, SwappedOut
from batchpage.engine.sequence import SeqStatus, Sequence
from batchpage.sampling_params import SamplingParams
from tests.engine.simulate import make_seq, simulate


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
    block_size=st.sampled_from([1, 4, 16]),
    spare_blocks=st.integers(0, 20),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(6, 64),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    policy=st.sampled_from(["lru", "lfu", "fifo"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    admission=st.booleans(),
    slacks=st.lists(st.integers(0, 10), min_size=12, max_size=12),
)
def test_random_workload_finishes_without_leaks(
    lengths,
    block_size,
    spare_blocks,
    max_num_seqs,
    budget,
    chunked,
    prefix_caching,
    policy,
    preemption,
    admission,
    slacks,
):
    max_len = max(p + o + slack for (p, o), slack in zip(lengths, slacks, strict=False))
    if not chunked:
        budget = max(budget, max_len)
    num_blocks = blocks_for(max_len, block_size) + spare_blocks
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, policy)
    sched = Scheduler(
        kv,
        max_num_seqs,
        budget,
        enable_chunked_prefill=chunked,
        preemption_mode=preemption,
        max_model_len=max_len,
        growth=GrowthEstimate() if admission else None,
    )
    # The budget is max_tokens, or unknown (max_model_len bounds it); ignore_eos makes it exact.
    seqs = [
        make_seq(i, p, SamplingParams(max_tokens=o + slack, ignore_eos=slack == 0))
        for i, ((p, o), slack) in enumerate(zip(lengths, slacks, strict=False))
    ]
    targets = {s.seq_id: o for s, (_, o) in zip(seqs, lengths, strict=True)}
    for s in seqs:
        sched.add(s)
    simulate(sched, targets, max_steps=10_000)
    assert not sched.has_unfinished()
    if kv.tree is not None:
        kv.tree.evict(num_blocks)  # what stays cached after the job is evictable
    assert kv.pool.num_free == num_blocks
    for s, (p, o) in zip(seqs, lengths, strict=True):
        assert s.status is SeqStatus.FINISHED
        assert s.output_token_ids == [1000 + p + k for k in range(o)]


def test_small_pool_preempts_the_newest_and_recovers():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make_seq(i, 7) for i in range(3)]  # 2 blocks each to start
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 2]
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.append_token(1)
    # Each now needs a third block at token 9: only the oldest two get one, the newest is
    # preempted and goes back to the front of the queue.
    for _ in range(2):
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            s.seq.append_token(1)
    assert sched.num_preemptions == 1
    assert seqs[2].status is SeqStatus.PREEMPTED and seqs[2].num_computed_tokens == 0
    assert list(sched.waiting) == [seqs[2]]
    sched.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_sequence_waits_as_preempted_and_keeps_its_first_cached_count(mode) -> None:
    """Preempted, a sequence is queued as PREEMPTED (never WAITING again: that is a sequence
    whose first admission is still to come); swapped out, its saved K/V is attached
    (SwappedOut: the tokens it had computed) until it is readmitted with them computed. Its
    num_cached_tokens stays what the cache served at its first admission (nothing: its prompt
    is its own), though its readmission borrows its own published blocks back."""
    kv = KVCacheManager(num_blocks=7, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode)
    seqs = [make_seq(i, 7) for i in range(3)]  # 2 blocks each to start, 1 spare
    for i, seq in enumerate(seqs):  # distinct prompts: nothing cached at first admission
        seq.token_ids = [100 * (i + 1) + t for t in range(7)]
        seq.request.prompt_token_ids = list(seq.token_ids)
        sched.add(seq)
    victim = seqs[2]
    computed_before = 0
    while sched.num_preemptions == 0:
        computed_before = victim.num_computed_tokens
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            kv.cache_progress(s.seq)
            s.seq.append_token(1)
        sched.check_integrity()
    assert out.preempted == [victim] and victim.num_cached_tokens == 0
    assert victim.status is SeqStatus.PREEMPTED and list(sched.waiting) == [victim]
    swapped = victim.feature(SwappedOut)
    assert (swapped.tokens if swapped is not None else None) == (
        computed_before if mode == "swap" else None
    )
    for seq in seqs[:2]:
        sched.finish(seq)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [victim] and victim.status is SeqStatus.RUNNING
    assert victim.feature(SwappedOut) is None
    if mode == "swap":
        assert [w.seq_id for w in out.swap_in] == [victim.seq_id]
        assert out.scheduled[0].num_new_tokens == victim.num_tokens - computed_before
    else:  # its own first block, published before it was preempted, is lent back
        assert out.scheduled[0].num_new_tokens < victim.num_tokens
    assert victim.num_cached_tokens == 0
    sched.check_integrity()


def test_prefix_cache_serves_shared_prompts_and_defers_one_step():
    kv = KVCacheManager(num_blocks=20, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq(0, 10), make_seq(1, 10)  # the same 10 tokens: 2 full blocks to share
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # b would share a's uncomputed blocks: it waits a step rather than compute them twice.
    assert [s.seq for s in out.scheduled] == [a]
    a.num_computed_tokens += 10
    kv.cache_progress(a)
    a.append_token(1010)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, b]
    assert b.num_cached_tokens == 8 and out.scheduled[1].num_new_tokens == 2
    assert b.block_table[:2] == a.block_table[:2]
    sched.check_integrity()


def test_a_sequence_waiting_for_a_shared_block_does_not_hold_back_the_queue_behind_it():
    kv = KVCacheManager(num_blocks=40, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(0, 10), make_seq(1, 10)  # the same 10 tokens: 2 full blocks to share
    c, d = make_seq(2, 6), make_seq(3, 9)
    c.token_ids = [100 + t for t in range(6)]  # nothing in common with a and b
    d.token_ids = [200 + t for t in range(9)]
    for seq in (a, b, c, d):
        sched.add(seq)
    out = sched.schedule()
    # b waits for a's blocks; c and d, queued behind it, run now; b keeps its place.
    assert [s.seq for s in out.scheduled] == [a, c, d]
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0 and not b.block_table
    sched.check_integrity()
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        kv.cache_progress(s.seq)
        s.seq.append_token(1)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, c, d, b]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    sched.check_integrity()


def test_prompt_scoring_sequences_with_a_shared_prefix_are_admitted_together() -> None:
    """Sequences that score their prompt never borrow cached blocks, so holding them back for a
    shared prefix (as plain ones are, to compute it once) would only run them one per step."""

    def scoring(i: int) -> Sequence:
        seq = make_seq(i, 12)
        seq.request.params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        return seq

    for make, admitted in ((scoring, 4), (lambda i: make_seq(i, 12), 1)):
        kv = KVCacheManager(num_blocks=64, block_size=4, prefix_caching=True)
        scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
        scheduler.add_batch([make(i) for i in range(4)])
        assert len(scheduler.schedule().scheduled) == admitted


class PublishLog:
    """A KV manager that records which sequences published their computed blocks."""

    num_blocks, block_size, tree = 64, 4, "a prefix cache"

    def __init__(self) -> None:
        self.published: list[int] = []

    def cache_progress(self, seq: Sequence) -> None:
        self.published.append(seq.seq_id)


def test_a_step_is_committed_by_each_rows_state_not_its_token_count() -> None:
    """update_from_output: a row prefills while its prompt is not all computed or more than its
    newest token waits (a recompute after preemption), whatever number of tokens the step gave
    it; a decode row given several (a speculative step) is not prefilling, a one-token prompt
    is. Prefilling rows publish their blocks; every row's computed count moves on."""
    # (prompt tokens, generated, computed before, new this step, prefill tokens it counts)
    rows = [
        (5, 0, 0, 5, 5),  # a whole prompt
        (5, 0, 3, 2, 2),  # a prompt's last chunk
        (1, 0, 0, 1, 1),  # a one-token prompt
        (5, 1, 5, 1, 0),  # a decode
        (5, 2, 6, 3, 0),  # a decode row given three tokens
        (5, 2, 0, 7, 7),  # recomputing a preempted sequence, outputs included
        (5, 3, 4, 3, 3),  # the same, its last chunk
    ]
    seqs = []
    for i, (prompt, generated, before, _, _) in enumerate(rows):
        seq = make_seq(i, prompt)
        seq.token_ids += [7] * generated
        seq.num_computed_tokens = before
        seqs.append(seq)
    kv = PublishLog()
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)  # type: ignore[arg-type]
    batch = scheduler.batch
    out = SchedulerOutput(
        batch,
        rows=np.array([batch.join(seq) for seq in seqs]),
        num_new=np.array([row[3] for row in rows]),
    )
    assert scheduler.update_from_output(out) == sum(r[4] for r in rows)
    assert kv.published == [i for i, row in enumerate(rows) if row[4]]
    assert [s.num_computed_tokens for s in seqs] == [row[2] + row[3] for row in rows]
