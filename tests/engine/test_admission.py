"""Admission by expected growth (engine/admission.py): the estimate's arithmetic, and on
simulated workloads that the pool stays busy without preempting what it admitted."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage.engine.admission import Demand, GrowthEstimate, OutputLimits
from batchpage.engine.kv_manager import KVCacheManager, blocks_for
from batchpage.engine.scheduler import Scheduler
from batchpage.sampling_params import SamplingParams
from tests.engine.simulate import make_seq, simulate


def _expected_all(g: GrowthEstimate, seqs: list, max_model_len: int) -> np.ndarray:
    now = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    return g.expected_tokens(now, OutputLimits.of(seqs), max_model_len)


def _expected(g: GrowthEstimate, seq) -> int:
    return int(_expected_all(g, [seq], 100)[0])


def test_expected_tokens_follow_budget_ignore_eos_and_min_tokens() -> None:
    g = GrowthEstimate(initial=0.7, certain_floor=0.5)
    plain = make_seq(0, 10, SamplingParams(max_tokens=40))
    assert _expected(g, plain) == 28  # 0.7 of 40 uncertain
    exact = make_seq(1, 10, SamplingParams(max_tokens=40, ignore_eos=True))
    assert _expected(g, exact) == 28  # certain, at the same 0.7
    floor = make_seq(2, 10, SamplingParams(max_tokens=40, min_tokens=30))
    assert _expected(g, floor) == 21 + 7  # 30 certain, 10 uncertain
    unbounded = make_seq(3, 10, SamplingParams(max_tokens=None, ignore_eos=True))
    assert _expected(g, unbounded) == 63  # of what max_model_len leaves
    g.ratio = 0.1  # decayed: uncertain growth at 0.1, certain growth never below half
    assert _expected(g, plain) == 4
    assert _expected(g, exact) == 20
    assert _expected(g, floor) == 15 + 1
    g.stepped(preempted=True)  # the worst case: every budget in full
    assert _expected(g, plain) == 40
    assert _expected(g, exact) == 40
    assert _expected(g, floor) == 40
    plain.token_ids += [7] * 40  # its budget is spent
    assert _expected(g, plain) == 0


@settings(max_examples=100, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(
            st.integers(1, 30),  # prompt
            st.integers(0, 40),  # generated
            st.one_of(st.none(), st.integers(1, 50)),  # max_tokens
            st.integers(0, 20),  # min_tokens
            st.booleans(),  # ignore_eos
        ),
        max_size=10,
    ),
    ratio=st.floats(0.1, 1.0),
)
def test_expected_tokens_of_many_equal_each_alone_by_the_formula(seqs, ratio) -> None:
    """The vectorised estimate against the module docstring's formula, one sequence at a time
    in plain Python."""
    g = GrowthEstimate(initial=0.7, certain_floor=0.5)
    g.ratio = ratio
    built = []
    for i, (prompt, generated, max_tokens, min_tokens, ignore_eos) in enumerate(seqs):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens or 20),
                                ignore_eos=ignore_eos)  # fmt: skip
        seq = make_seq(i, prompt, params)
        seq.token_ids += [7] * generated
        built.append(seq)
    want = []
    for seq in built:
        p, out = seq.params, seq.num_output_tokens
        remaining = 80 - seq.num_tokens
        if p.max_tokens is not None:
            remaining = min(remaining, p.max_tokens - out)
        remaining = max(0, remaining)
        certain = remaining if p.ignore_eos else min(remaining, max(0, p.min_tokens - out))
        share = max(ratio, 0.5)
        want.append(math.ceil(share * certain) + round(ratio * (remaining - certain)))
    assert _expected_all(g, built, 80).tolist() == want


@settings(max_examples=200, deadline=None)
@given(
    futures=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12),
    extra=st.tuples(st.integers(0, 60), st.integers(0, 60)),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_peak_blocks_bounds_the_brute_force_peak(futures, extra, block_size) -> None:
    """Against stepping every sequence one token at a time and freeing it when done: never
    below the true peak, and above it by less than one block per sequence."""

    def brute(items: list[tuple[int, int]]) -> int:
        horizon = max((c for _, c in items), default=0)
        return max(
            (
                sum(blocks_for(now + t, block_size) for now, c in items if c >= t)
                for t in range(horizon + 1)
            ),
            default=0,
        )

    demand = Demand(block_size)
    for now, to_come in futures:
        demand.add(now, to_come)
    at_once = Demand(block_size)  # the same sequences added in one call
    at_once.add_all(np.array([n for n, _ in futures]), np.array([c for _, c in futures]), held=0)
    alone = demand.peak_blocks()
    assert at_once.peak_blocks() == alone and at_once.peak_blocks(extra) == demand.peak_blocks(
        extra
    )
    for items, got in [(futures, alone), ([*futures, extra], demand.peak_blocks(extra))]:
        want = brute(items)
        assert want <= got <= want + len(items)
    assert demand.peak_blocks() == alone  # asking with `extra` does not keep it


@settings(max_examples=200, deadline=None)
@given(
    futures=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), max_size=12),
    extra=st.tuples(st.integers(0, 60), st.integers(0, 60)),
    block_size=st.sampled_from([1, 4, 16]),
    asks=st.sets(st.integers(0, 11)),
    slack=st.integers(-3, 3),
)
def test_fits_is_the_peak_against_the_capacity(futures, extra, block_size, asks, slack) -> None:
    """fits(extra, capacity) against peak_blocks(extra) <= capacity, at capacities around the
    peak and the sum bound, with peaks asked between adds (sequences sorted in part by part),
    and the peak against a Demand that sorted every add at once."""
    demand, at_once = Demand(block_size), Demand(block_size)
    for i, (now, to_come) in enumerate(futures):
        demand.add(now, to_come)
        at_once.add_all(np.array([now]), np.array([to_come]), held=0)
        if i in asks:
            assert demand.peak_blocks() == at_once.peak_blocks()
    peak = at_once.peak_blocks(extra)
    largest = sum(blocks_for(n + c, block_size) for n, c in [*futures, extra])
    for capacity in {peak + slack, peak, peak - 1, largest + slack, largest, 0}:
        assert demand.fits(extra, capacity) == (peak <= capacity), capacity
    assert demand.peak_blocks(extra) == peak and demand.peak_blocks() == at_once.peak_blocks()


def test_ratio_decays_to_its_floor_and_resets_on_preemption() -> None:
    g = GrowthEstimate(initial=0.7, floor=0.1, decay=0.25)
    g.stepped(preempted=False)
    assert g.ratio == pytest.approx(0.45)
    for _ in range(5):
        g.stepped(preempted=False)
    assert g.ratio == 0.1
    g.stepped(preempted=True)
    assert g.ratio == 1.0
    with pytest.raises(ValueError, match="floor"):
        GrowthEstimate(initial=0.1, floor=0.5)
    with pytest.raises(ValueError, match="certain_floor"):
        GrowthEstimate(certain_floor=0.0)


def sharegpt_like(seed: int, n: int, ignore_eos: bool) -> tuple[list, dict[int, int]]:
    """Prompts of 20-200 tokens, outputs of 1-96 tokens (the budget 96 unless ignore_eos, when
    the budget is the exact length): the shape of short ShareGPT first turns."""
    rng = random.Random(seed)
    seqs, targets = [], {}
    for i in range(n):
        prompt, out = rng.randint(20, 200), rng.randint(1, 96)
        params = SamplingParams(max_tokens=out if ignore_eos else 96, ignore_eos=ignore_eos)
        seq = make_seq(i, prompt, params)
        # Distinct prompts: no prefix sharing, so the pool's size alone decides.
        seq.token_ids = [rng.randrange(900) for _ in range(prompt)]
        seq.request.prompt_token_ids = list(seq.token_ids)  # its prompt's length: prompt
        seqs.append(seq)
        targets[i] = out
    return seqs, targets


@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_admission_by_growth_preempts_at_most_one_in_four(ignore_eos: bool, seed: int) -> None:
    """48 requests, max_model_len 384, a pool for six such sequences (the workload on which
    admission on the prompt alone preempted 38 times): with the estimate, at most 12."""

    def run(growth: GrowthEstimate | None) -> tuple[int, int]:
        seqs, targets = sharegpt_like(seed, 48, ignore_eos)
        kv = KVCacheManager(num_blocks=6 * 384 // 16, block_size=16)
        sched = Scheduler(kv, 256, 2048, max_model_len=384, growth=growth)
        for s in seqs:
            sched.add(s)
        result = simulate(sched, targets)
        for s in seqs:  # every sequence finished with its exact output
            assert s.output_token_ids == [
                1000 + s.num_prompt_tokens + k for k in range(targets[s.seq_id])
            ]
        assert kv.pool.num_free == kv.num_blocks
        return sched.num_preemptions, result.tokens_computed

    greedy_preemptions, greedy_work = run(None)
    preemptions, work = run(GrowthEstimate())
    assert preemptions <= 48 // 4
    assert preemptions < greedy_preemptions  # the workload does thrash without the estimate
    assert work < greedy_work  # less computed twice


def test_an_empty_pool_admits_a_sequence_that_may_outgrow_it() -> None:
    """The estimate may exceed the pool (a budget up to max_model_len): the first sequence still
    runs, or the job would stall."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, 4, 64, max_model_len=16, growth=GrowthEstimate(initial=1.0))
    seqs = [make_seq(i, 3, SamplingParams(max_tokens=None)) for i in range(2)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    # Each may grow to 16 tokens = the whole pool: one at a time.
    assert [s.seq for s in out.scheduled] == [seqs[0]]
    simulate(sched, {0: 5, 1: 5})
    assert sched.num_preemptions == 0
