"""The batched sampler against HF transformers' logits processors and plain-Python references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from batchpage.engine.sampler import (
    Penalties,
    RowParams,
    TokenMask,
    apply_filters,
    apply_penalties,
    compute_logprobs,
    draw_keys,
    sample,
)
from batchpage.ops.race import exponential_race, race_noise
from batchpage.sampling_params import SamplingParams

VOCAB = 64


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _random_ids(rows: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, length), generator=g).tolist()


def _keys(seeds, positions=None) -> torch.Tensor:
    positions = np.zeros(len(seeds), dtype=np.int64) if positions is None else positions
    return draw_keys(np.array(seeds, dtype=np.int64), np.asarray(positions, dtype=np.int64))


def _sample(logits, params, seeds=None, prompt=None, output=None, eos=None, mask=None, at=None):
    """sample() over per-row lists: row i's seed (default 1000 + i) drawing at position at[i]
    (default 0)."""
    n = len(params)
    seeds = [1000 + i for i in range(n)] if seeds is None else seeds
    penalties = Penalties.of(params, prompt or [[]] * n, output or [[]] * n, eos)
    return sample(
        logits,
        RowParams.of(params),
        _keys(seeds, at),
        penalties if penalties.rows else None,
        token_mask=mask,
    )


def test_greedy_batch_is_argmax_and_leaves_logits_alone() -> None:
    logits = _logits(5)
    before = logits.clone()
    out = _sample(logits, [SamplingParams(temperature=0)] * 4 + [SamplingParams(top_k=1)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


def test_processing_never_modifies_the_input() -> None:
    logits = _logits(3)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={1: 3.0}),
        SamplingParams(temperature=0.7, top_p=0.5, min_p=0.1, presence_penalty=1.0),
        SamplingParams(top_k=3, min_tokens=2),
    ]
    _sample(logits, params, prompt=[[1, 2]] * 3, output=[[3]] * 3, eos=[{0}] * 3)
    assert torch.equal(logits, before)


def test_repetition_penalty_matches_hf() -> None:
    logits = _logits(4, seed=1)
    penalties = [1.0, 1.3, 0.7, 2.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    prompts, outputs = _random_ids(4, 12, seed=2), _random_ids(4, 5, seed=3)
    got = apply_penalties(logits.clone(), Penalties.of(params, prompts, outputs, [()] * 4))
    for i, penalty in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], expected[0])


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = _logits(3, seed=4)
    params = [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-0.3),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
    ]
    prompts, outputs = _random_ids(3, 20, seed=5), _random_ids(3, 30, seed=6)
    got = apply_penalties(logits.clone(), Penalties.of(params, prompts, outputs, [()] * 3))
    for i, p in enumerate(params):
        expected = logits[i].tolist()
        for token in range(VOCAB):  # prompt tokens are not penalised
            count = outputs[i].count(token)
            expected[token] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
        torch.testing.assert_close(got[i], torch.tensor(expected))


def test_logit_bias_and_min_tokens() -> None:
    logits = _logits(3, seed=7)
    params = [
        SamplingParams(logit_bias={3: 100.0, 5: -2.5}),
        SamplingParams(min_tokens=2, stop_token_ids=[9]),
        SamplingParams(min_tokens=2, stop_token_ids=[9], ignore_eos=True),
    ]
    eos = [{0}, {0, 1}, {0, 1}]
    got = apply_penalties(logits.clone(), Penalties.of(params, [[]] * 3, [[], [4], [4]], eos))
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 5] -= 2.5
    expected[1, [0, 1, 9]] = -math.inf
    expected[2, 9] = -math.inf  # ignore_eos: EOS is not a stop, so it is not masked
    torch.testing.assert_close(got, expected)
    # Once the output is min_tokens long the mask is gone.
    after = apply_penalties(
        logits[1:2].clone(), Penalties.of(params[1:2], [[]], [[4, 4]], eos[1:2])
    )
    torch.testing.assert_close(after, logits[1:2])
    # Greedy rows take the argmax of the processed logits.
    assert _sample(
        logits[:1], [SamplingParams(temperature=0, logit_bias={3: 100.0})]
    ).token_ids == [3]


def _hf_warpers(p: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    scores = logits.unsqueeze(0).clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores[0]


FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(top_p=0.3, top_k=10),
    SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(top_k=VOCAB + 5),
]


@pytest.mark.parametrize("case", range(len(FILTER_CASES)))
def test_filters_match_hf_warpers_one_row(case: int) -> None:
    p = FILTER_CASES[case]
    logits = _logits(1, seed=10 + case)
    got = apply_filters(logits.clone(), RowParams.of([p]))[0]
    torch.testing.assert_close(got, _hf_warpers(p, logits[0]))


def test_filters_match_hf_warpers_mixed_batch() -> None:
    # Different settings per row exercise the vectorised paths (per-row k, p, temperature).
    logits = _logits(len(FILTER_CASES), seed=20)
    got = apply_filters(logits.clone(), RowParams.of(FILTER_CASES))
    for i, p in enumerate(FILTER_CASES):
        torch.testing.assert_close(got[i], _hf_warpers(p, logits[i]))
    only_k = [SamplingParams(top_k=k) for k in (1, 3, 0, 7)]
    got = apply_filters(logits[:4].clone(), RowParams.of(only_k))
    for i, p in enumerate(only_k):
        torch.testing.assert_close(got[i], _hf_warpers(p, logits[i]))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=6),
        SamplingParams(temperature=1.5, top_p=0.7),
        SamplingParams(min_p=0.1, repetition_penalty=1.4),
    ],
    ids=["top_k", "top_p", "min_p+penalty"],
)
def test_sampled_frequencies_match_filtered_distribution(params: SamplingParams) -> None:
    vocab, draws = 12, 6000
    row = _logits(1, vocab=vocab, seed=30)
    prompt = [[2, 3]]
    expected_logits = apply_penalties(row.clone(), Penalties.of([params], prompt, [[]]))
    expected = apply_filters(expected_logits, RowParams.of([params]))[0].softmax(-1)
    # One call, many rows, each with a seed of its own: the draws across rows.
    out = _sample(row.expand(draws, vocab), [params] * draws, list(range(draws)), prompt * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    kept = expected > 0
    mean = expected[kept].double() * draws
    chi2 = ((counts[kept] - mean) ** 2 / mean).sum().item()
    # df <= 11; chi-square's 1e-6 upper quantile for df = 11 is about 46: a loose, stable bound.
    assert chi2 < 46, (chi2, counts.tolist(), mean.tolist())


def test_one_seeds_draws_at_successive_positions_sample_the_distribution() -> None:
    """The draws of one sequence (one seed, the positions it samples at) follow its
    distribution."""
    params = SamplingParams(temperature=1.0, top_k=3)
    row = _logits(1, vocab=8, seed=31)
    out = _sample(row.expand(3000, 8), [params] * 3000, [77] * 3000, at=np.arange(3000))
    expected = apply_filters(row.clone(), RowParams.of([params]))[0].softmax(-1)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=8).double() / 3000
    assert torch.allclose(freq, expected.double(), atol=0.04)


def _decode_steps(batch: list[tuple[SamplingParams, int | None]], steps: int, logits_seed: int):
    """Run ``steps`` sampling steps over a batch (a row without a seed of its own takes its
    place in the batch as one); return each row's tokens."""
    seeds = [i if s is None else s for i, (_, s) in enumerate(batch)]
    params = [p for p, _ in batch]
    outputs: list[list[int]] = [[] for _ in batch]
    for step in range(steps):
        # Every row sees the same logits at a step, so only batch composition differs.
        logits = _logits(1, seed=logits_seed + step).expand(len(batch), VOCAB)
        at = [2 + step] * len(batch)  # after a prompt of two tokens
        out = _sample(logits, params, seeds, [[1, 2]] * len(batch), outputs, at=at)
        for row, token in zip(outputs, out.token_ids, strict=True):
            row.append(token)
    return outputs


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    seeded = (SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.5), 1234)
    alone = _decode_steps([seeded], steps=8, logits_seed=40)[0]
    others = [
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=1.2, top_k=4), 7),
        (SamplingParams(temperature=0.5, min_p=0.2, repetition_penalty=1.2), None),
    ]
    for batch in ([*others, seeded], [seeded, *others[::-1]], [others[1], seeded, others[0]]):
        rows = _decode_steps(batch, steps=8, logits_seed=40)
        assert rows[batch.index(seeded)] == alone
    other_seed = _decode_steps([(seeded[0], 4321)], steps=8, logits_seed=40)[0]
    assert other_seed != alone


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = _logits(3, seed=50)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.3, top_k=2, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0),
    ]
    out = _sample(logits, params, prompt=[[1]] * 3, output=[[2]] * 3)
    raw = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and first.rank == 1
    assert first.top_ids == raw[0].topk(3).indices.tolist()
    assert first.top_logprobs == pytest.approx(raw[0].topk(3).values.tolist())
    second = out.logprobs[1]
    token = out.token_ids[1]
    assert second.logprob == pytest.approx(raw[1, token].item())
    assert second.rank == int((raw[1] > raw[1, token]).sum()) + 1
    assert second.top_ids == [] and second.top_logprobs == []
    assert out.logprobs[2] is None


def test_compute_logprobs_for_prompt_positions() -> None:
    logits = _logits(4, seed=51)
    targets = torch.tensor([5, 6, 7, 8])
    got = compute_logprobs(logits, targets, [2, None, 0, 1])
    assert got[1] is None
    assert [g.token_id for g in got if g] == [5, 7, 8]
    assert got[0].logprob == pytest.approx(logits[0].log_softmax(-1)[5].item())


def test_half_precision_logits() -> None:
    logits = _logits(2, seed=52).to(torch.bfloat16)
    params = [SamplingParams(temperature=0, repetition_penalty=1.1), SamplingParams(top_p=0.5)]
    out = _sample(logits, params, [0, 0], [[1]] * 2, [[2]] * 2)
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="one entry per logits row"):
        sample(_logits(2), RowParams.of([SamplingParams()]), _keys([0]))
    with pytest.raises(ValueError, match="penalties must cover"):
        sample(_logits(1), RowParams.of([SamplingParams(presence_penalty=1.0)]), _keys([0]))


def _random_token_mask(rows: int, masked: list[int], vocab: int, seed: int) -> tuple:
    """A packed bitmask (xgrammar's layout) for the masked rows, and the same as sets of ids."""
    g = torch.Generator().manual_seed(seed)
    allowed = [set() for _ in range(rows)]
    for r in masked:
        allowed[r] = set(torch.randperm(vocab, generator=g)[: 3 + r * 7 % 11].tolist())
    words = -(-vocab // 32)
    packed = [[0] * words for _ in range(rows)]
    for r in range(rows):
        for t in allowed[r] if r in masked else range(vocab):
            packed[r][t // 32] |= 1 << (t % 32)
    as_int32 = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in packed]
    return TokenMask(torch.tensor(as_int32, dtype=torch.int32), masked), allowed


@pytest.mark.parametrize("vocab", [VOCAB, 70])  # 70: the last word of the bitmask is partial
def test_token_mask_restricts_only_its_rows(vocab: int) -> None:
    logits = _logits(6, vocab=vocab, seed=60)
    before = logits.clone()
    masked = [1, 2, 4, 5]
    mask, allowed = _random_token_mask(6, masked, vocab, seed=61)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=0, presence_penalty=1.0),
        SamplingParams(temperature=1.5, top_k=3),
    ]
    seeds = [70 + i for i in range(6)]
    out = _sample(logits, params, seeds, [[1]] * 6, [[2, 3]] * 6, mask=mask)
    plain = _sample(logits, params, seeds, [[1]] * 6, [[2, 3]] * 6)
    assert torch.equal(logits, before)
    for r in range(6):
        if r in masked:
            assert out.token_ids[r] in allowed[r]
        else:  # unconstrained rows: the same token as without any mask in the batch
            assert out.token_ids[r] == plain.token_ids[r]
    # A greedy masked row takes the best allowed token.
    best = max(allowed[1], key=lambda t: logits[1, t].item())
    assert out.token_ids[1] == best


def test_token_mask_sampled_rows_follow_the_renormalised_distribution() -> None:
    logits = _logits(1, seed=62)
    mask, allowed = _random_token_mask(1, [0], VOCAB, seed=63)
    ids = sorted(allowed[0])
    want = logits[0, ids].softmax(-1)
    draws = 4000
    counts = torch.zeros(len(ids))
    params = [SamplingParams(temperature=1.0)]
    for step in range(draws):
        token = _sample(logits, params, [5], mask=mask, at=[step]).token_ids[0]
        counts[ids.index(token)] += 1
    assert torch.allclose(counts / draws, want, atol=0.03)


def test_race_noise_is_exponential() -> None:
    """The counter-based noise against Exp(1): its mean and the share past 1 and 3 over a
    million values (keys across rows, tokens along them), and rows of other keys uncorrelated."""
    noise = race_noise(_keys(range(1000), [3] * 1000), 1000).double()
    assert noise.min() > 0
    assert noise.mean().item() == pytest.approx(1.0, abs=0.005)
    assert (noise > 1).double().mean().item() == pytest.approx(math.exp(-1), abs=0.002)
    assert (noise > 3).double().mean().item() == pytest.approx(math.exp(-3), abs=0.001)
    corr = torch.corrcoef(noise[:2])[0, 1].item()
    assert abs(corr) < 0.15


def test_a_row_drawn_alone_draws_the_same_in_a_batch() -> None:
    """exponential_race depends on a row's own probabilities and key only."""
    probs = _logits(9, seed=90).softmax(-1)
    keys = _keys(range(9), range(9))
    together = exponential_race(probs, keys).tolist()
    assert together == [
        exponential_race(probs[i : i + 1], keys[i : i + 1]).item() for i in range(9)
    ]
    assert exponential_race(probs.flip(0), keys.flip(0)).tolist() == together[::-1]


def test_draw_keys_are_the_top_of_a_splitmix64_step() -> None:
    """draw_keys against SplitMix64 written out in Python integers."""

    def splitmix(seed: int, position: int) -> int:
        mask = 2**64 - 1
        x = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return (x ^ (x >> 31)) >> 32

    seeds, positions = [0, 1, 2**62 + 5, 2**63 - 1], [0, 7, 4096, 123456]
    got = draw_keys(np.array(seeds, dtype=np.int64), np.array(positions, dtype=np.int64))
    assert got.tolist() == [splitmix(s, p) for s, p in zip(seeds, positions, strict=True)]
