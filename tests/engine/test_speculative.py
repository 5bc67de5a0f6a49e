"""Speculative decoding in the engine: drafted tokens verified in the one forward never change
what a row takes. The reference is the same engine without speculation (every position drawn
from the same logits with the same key, speculative/verify.py), checked after every step
(check_integrity), on the tiny random model whose greedy outputs loop, so n-gram drafts are
often right, and with drafters that are right, wrong and partly right on purpose."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from batchpage import LLM, SamplingParams, StructuredOutputsParams
from batchpage.speculative.verify import accepted_counts
from tests.engine.speculation import Oracle, WeightBound
from tests.speculative.test_ngram import reference

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}


def _llm(folder: Path, spec: dict | None, **kw: object) -> LLM:
    linears = "auto" if kw.get("batch_invariant") else "torch"
    options = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 2**24,
               "linear_backend": linears, **kw}  # fmt: skip
    llm = LLM(str(folder), speculative_config=spec, **options)
    llm.engine.check_integrity_each_step = True
    if llm.engine.drafts is not None:
        llm.engine.drafts.cost = WeightBound()  # type: ignore[assignment]
    return llm


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, 200) for _ in range(12)]
    return [base[: rng.randrange(4, 12)] + [rng.randrange(3, 200) for _ in range(6)] for _ in
            range(n)]  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.text) for c in r.outputs] for r in outs]


def _logprobs(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        [(t, sorted(lp.items())) for t, lp in zip(c.token_ids, c.logprobs or [], strict=True)]
        for r in outs
        for c in r.outputs
    ]


@pytest.fixture(scope="module")
def plain(tiny_folder: Path) -> LLM:
    return _llm(tiny_folder, None)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_and_seeded_rows_take_the_tokens_they_take_without_speculation(
    tiny_folder: Path, plain: LLM, spec: dict
) -> None:
    llm = _llm(tiny_folder, spec)
    prompts = _prompts(10)
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=25, n=3, seed=1),  # forks, then drafts
    ]
    for params in cases:
        assert _run(llm, prompts, params) == _run(plain, prompts, params), params
        stats = llm.engine.stats
        assert stats.draft_tokens > 0, params  # it did speculate


def test_logprobs_are_those_of_the_run_without_speculation(tiny_folder: Path, plain: LLM) -> None:
    llm = _llm(tiny_folder, NGRAM)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True)
    ours, theirs = _logprobs(llm, _prompts(6), params), _logprobs(plain, _prompts(6), params)
    assert [[t for t, _ in row] for row in ours] == [[t for t, _ in row] for row in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for (_, lp_a), (_, lp_b) in zip(a, b, strict=True):
            assert [k for k, _ in lp_a] == [k for k, _ in lp_b]
            got = np.array([v for _, v in lp_a])
            want = np.array([v for _, v in lp_b])
            np.testing.assert_allclose(got, want, atol=1e-4)
    assert llm.engine.stats.accepted_draft_tokens > 0


def test_stops_inside_accepted_drafts_end_the_row_there(tiny_folder: Path, plain: LLM) -> None:
    """A stop token id, a length limit or a stop string met at an accepted draft before the
    last: the row ends there, as it does without speculation (the later tokens are not taken),
    and its blocks go back with only the tokens it kept."""
    llm = _llm(tiny_folder, NGRAM)
    prompts = _prompts(8, seed=3)
    free = _run(plain, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    # Ids each greedy output takes late in its loop: they come as accepted drafts.
    stop_ids = sorted({toks[-3] for row in free for toks, _, _ in row})[:4]
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=stop_ids),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[free[0][0][2][5:8]]),
    ]
    for params in cases:
        assert _run(llm, prompts, params) == _run(plain, prompts, params), params


def test_preemption_and_the_prefix_cache_keep_outputs(tiny_folder: Path, plain: LLM) -> None:
    """A pool that preempts, shared prefixes that hit the cache: drafted tokens' K/V is never
    published past what a row accepted, so later rows that hit the cache read right K/V."""
    pool = {"kv_cache_memory": 14 * 4096, "block_size": 8, "max_model_len": 96}  # 14 blocks
    llm, small = _llm(tiny_folder, NGRAM, **pool), _llm(tiny_folder, None, **pool)
    prompts = _prompts(12, seed=5)
    params = SamplingParams(n=3, temperature=0.05, seed=7, max_tokens=40, ignore_eos=True)
    assert _run(llm, prompts, params) == _run(small, prompts, params)
    assert llm.engine.stats.preemptions > 0 and llm.engine.stats.accepted_draft_tokens > 0
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert _run(llm, prompts, params) == _run(plain, prompts, params)
    # Again: now the prompts and outputs hit what the first run cached.
    assert _run(llm, prompts, params) == _run(plain, prompts, params)


def test_each_rows_drafts_are_prompt_lookup_over_its_own_tokens(tiny_folder: Path) -> None:
    """After every step of a run that preempts (rows admitted again elsewhere, their rows taken
    by others), each decode row's drafts are the brute-force prompt lookup over the tokens its
    sequence holds, as many as its length limit allows: the drafter follows each row's own
    sequence through the batch's columns."""
    pool = {"kv_cache_memory": 14 * 4096, "block_size": 8, "max_model_len": 96}  # 14 blocks
    llm = _llm(tiny_folder, NGRAM, **pool)
    engine, batch = llm.engine, llm.engine.batch
    params = SamplingParams(n=3, temperature=0.05, seed=7, max_tokens=40, ignore_eos=True)
    prompts = _prompts(12, seed=5)
    engine.add_requests([llm._make_request(i, p, params) for i, p in enumerate(prompts)])
    low, high = NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]
    k = NGRAM["num_speculative_tokens"]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for row in range(batch.capacity):
            if not batch.in_use(row):
                continue
            tokens = batch.seq_at(row).token_ids
            n = len(tokens)
            decoding = batch.speculates[row] and batch.computed[row] == n - 1
            cap = max(0, min(int(batch.stop_len[row]) - n - 1, 96 - n, k)) if decoding else 0
            want = reference(tokens, low, high, cap)
            got = batch.drafts[row, : batch.num_drafts[row]].tolist()
            assert got == want, (row, tokens)
            checked += bool(want)
    assert engine.stats.preemptions > 0 and checked > 20


def test_the_suffix_cache_outlives_a_run_as_a_jobs_windows_need(tiny_folder: Path) -> None:
    """A job's windows are separate runs (generate calls): the outputs the suffix drafter
    cached in one are there for the next, whose rows repeat them (the same prompts again),
    while the rows of the first run are let go."""
    llm = _llm(tiny_folder, {**SUFFIX, "suffix_decoding_max_spec_factor": 4.0})
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = _run(llm, prompts, params)
    own = llm.engine.stats  # drafts from each row's own tokens only
    drafts = llm.engine.drafts
    assert drafts is not None
    cached = drafts.drafter.cached_outputs  # type: ignore[attr-defined]
    assert sorted(cached) == sorted(list(r[0][0]) for r in first)
    again = _run(llm, prompts, params)
    stats = llm.engine.stats
    assert again == first and stats.draft_tokens > 0
    # The repetitive tiny model drafts well from its own tokens already; its own outputs do
    # better (a run of one token ends where the cached output says, not where counts guess).
    rate = stats.accepted_draft_tokens / stats.draft_tokens
    assert rate > own.accepted_draft_tokens / own.draft_tokens and rate > 0.8
    assert drafts.drafter.num_sequences == 0  # type: ignore[attr-defined]
    drafts.drafter.check_integrity()


def test_outputs_of_rows_not_followed_are_cached_too(tiny_folder: Path) -> None:
    """Above disable_by_batch_size nothing drafts and no row is followed; the suffix drafter
    caches the finished outputs all the same, for later rows when drafts pay again."""
    llm = _llm(tiny_folder, {**SUFFIX, "disable_by_batch_size": 2})
    prompts = _prompts(5, seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = _run(llm, prompts, params)
    drafts = llm.engine.drafts
    assert drafts is not None and llm.engine.stats.draft_tokens == 0
    cached = drafts.drafter.cached_outputs  # type: ignore[attr-defined]
    assert sorted(cached) == sorted(list(r[0][0]) for r in first)
    drafts.drafter.check_integrity()


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_right_wrong_and_partly_right_drafts_never_change_greedy_output(
    tiny_folder: Path, plain: LLM, wrong: float
) -> None:
    prompts = _prompts(12, seed=11)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _run(plain, prompts, params)
    answers = {tuple(p): row[0][0] for p, row in zip(prompts, want, strict=True)}
    llm = _llm(tiny_folder, NGRAM)
    assert llm.engine.drafts is not None
    oracle = Oracle(answers, wrong, seed=int(wrong * 10))
    llm.engine.drafts.drafter = oracle
    assert _run(llm, prompts, params) == want
    stats = llm.engine.stats
    assert stats.draft_tokens > 0
    # A row that joins starts from the engine's acceptance so far: the oracle's odds.
    prior = llm.engine.drafts.prior
    if wrong == 0.0:  # every draft right: accepted but where the length limit cut them
        assert stats.accepted_draft_tokens == stats.draft_tokens and prior == 1.0
    if wrong == 1.0:  # a random token is right only by chance
        assert stats.accepted_draft_tokens < stats.draft_tokens / 10 and prior < 0.1
    if wrong == 0.3:
        assert 0.2 < prior < 0.9


def test_batch_invariant_logprobs_are_bitwise_those_without(tiny_folder: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    prompts = _prompts(5, seed=2)
    got = _logprobs(_llm(tiny_folder, NGRAM, batch_invariant=True), prompts, params)
    want = _logprobs(_llm(tiny_folder, None, batch_invariant=True), prompts, params)
    assert got == want


def test_accepted_counts_against_a_plain_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, k = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        counts = rng.integers(1, k + 1, size=n)
        targets = rng.integers(0, 3, size=(n, k))
        drafts = rng.integers(0, 3, size=(n, k - 1))
        want = []
        for i in range(n):
            a = 0
            while a < counts[i] - 1 and drafts[i, a] == targets[i, a]:
                a += 1
            want.append(a)
        assert accepted_counts(targets, drafts, counts).tolist() == want


def test_speculative_config_errors_name_the_option(tiny_folder: Path) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_folder), speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="kv_allocator"):
        LLM(str(tiny_folder), kv_allocator="static", speculative_config=NGRAM)


def test_drafts_take_only_the_budget_every_rows_newest_token_leaves(
    tiny_folder: Path, plain: LLM
) -> None:
    """A step's budget (max_num_batched_tokens) goes to every running row's own token first:
    drafts never push a row out of a step, so speculation takes no more steps than none."""
    prompts = [[3 + i, 40 + i, 7, 9] for i in range(12)]  # all admitted within two steps
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = {"max_num_batched_tokens": 24, "max_num_seqs": 12}
    without = _llm(tiny_folder, None, **tight)
    llm = _llm(tiny_folder, NGRAM, **tight)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def every_decode_row_runs():  # noqa: ANN202
        decoding = {s.row for s in scheduler.running if s.num_computed_tokens == s.num_tokens - 1}
        out = schedule()
        assert decoding <= set(out.rows.tolist()), "a decode row was left out for drafts"
        return out

    scheduler.schedule = every_decode_row_runs  # type: ignore[method-assign]
    assert _run(llm, prompts, params) == _run(without, prompts, params)
    assert llm.engine.stats.draft_tokens > 0


@pytest.mark.parametrize("wrong", [0.0, 0.4])
def test_grammar_rows_speculate_and_keep_their_tokens(
    tiny_folder: Path, plain: LLM, wrong: float
) -> None:
    """Structured-output rows run drafts: drafts are cut at the first one their grammar rejects
    and each drafted position is masked by the grammar after the drafts before it, so greedy
    and seeded rows take the tokens (and text) of the run without speculation, and every
    output still matches its grammar."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}  # fmt: skip
    kinds = [StructuredOutputsParams(regex="[a-z]+( [a-z]+)*"),
             StructuredOutputsParams(json=schema)]  # fmt: skip
    prompts = _prompts(8, seed=13)
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=28,
                       structured_outputs=kinds[i % 2])
        for i in range(len(prompts))
    ]  # fmt: skip
    want = _run(plain, prompts, params)
    answers = {tuple(p): row[0][0] for p, row in zip(prompts, want, strict=True)}
    llm = _llm(tiny_folder, NGRAM)
    assert llm.engine.drafts is not None
    llm.engine.drafts.drafter = Oracle(answers, wrong, seed=7)
    assert _run(llm, prompts, params) == want
    stats = llm.engine.stats
    assert stats.accepted_draft_tokens > 0
    if wrong == 0.0:  # right drafts are all in the grammar: every one run is accepted
        assert stats.accepted_draft_tokens == stats.draft_tokens
    for (_, _, text), kind in zip((r[0] for r in want), (p.structured_outputs for p in params),
                                  strict=True):  # fmt: skip
        if kind is not None and kind.json is not None and text.endswith("}"):
            assert set(json.loads(text)) == {"a", "b"}
