"""NgramDrafter against a brute-force prompt lookup (every earlier position scanned for every n)
over random start/append/propose/finish/restart runs on small vocabularies, with
check_integrity after every operation; vLLM's documented example; bounds and errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchpage.speculative.ngram import NgramDrafter


def reference(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The longest n in [low, high] whose last n tokens occur earlier (ending before the last
    token); of those occurrences the earliest; the tokens after it, up to k."""
    end = len(tokens)
    if k <= 0:
        return []
    for n in range(high, low - 1, -1):
        if n > end:
            continue
        tail = tokens[end - n :]
        for at in range(n, end):  # `at`: end (exclusive) of an earlier occurrence
            if tokens[at - n : at] == tail:
                return tokens[at : at + k]
    return []


def test_vllm_example() -> None:
    # vLLM's NgramProposer docstring: [1,2,3,4,2,3], min 2, max 3, k 4 -> [4, 2, 3].
    d = NgramDrafter(2, 3)
    d.start(0, [1, 2, 3, 4, 2, 3])
    assert d.propose(0, 4).tolist() == [4, 2, 3]
    assert d.propose(0, 4).dtype == np.int64


def test_longest_n_then_earliest_occurrence() -> None:
    d = NgramDrafter(1, 3)
    # "7 8" occurs at 0 and 4; "9 7 8" nowhere before the end; "7 8" earliest -> after index 2.
    tokens = [7, 8, 1, 2, 7, 8, 3, 9, 7, 8]
    d.start(5, tokens)
    assert d.propose(5, 3).tolist() == [1, 2, 7] == reference(tokens, 1, 3, 3)
    d.append(5, [1])  # "8 1" at 1..2: a 2-gram match beats the 1-gram "1"
    assert d.propose(5, 2).tolist() == [2, 7]
    d.append(5, [5])  # nothing ends in 5 before: no draft
    assert d.propose(5, 4).tolist() == []
    d.check_integrity()


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    low = rng.randint(1, 3)
    high = rng.randint(low, 5)
    vocab = rng.choice([2, 3, 5])
    d = NgramDrafter(low, high)
    model: dict[int, list[int]] = {}
    next_key = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.1 or not model:
            key = next_key
            next_key += 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            d.start(key, prompt)
            model[key] = list(prompt)
        elif op < 0.55:
            key = rng.choice(list(model))
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            d.append(key, np.array(new))  # numpy input is accepted
            model[key].extend(new)
        elif op < 0.85:
            key = rng.choice(list(model))
            k = rng.randint(0, 6)
            got = d.propose(key, k).tolist()
            assert got == reference(model[key], low, high, k), (seed, key, k)
        elif op < 0.93:
            key = rng.choice(list(model))
            d.finish(key)
            del model[key]
        else:  # a restart after preemption: everything so far comes back as the prompt
            key = rng.choice(list(model))
            d.start(key, model[key])
        d.check_integrity()
        assert d.num_sequences == len(model)


@pytest.mark.parametrize("seed", range(4))
def test_propose_many_matches_propose(seed: int) -> None:
    rng = random.Random(100 + seed)
    d = NgramDrafter(1, 4)
    keys = list(range(20))
    for key in keys:
        d.start(key, [rng.randrange(3) for _ in range(rng.randint(0, 40))])
    ks = np.array([rng.randint(0, 7) for _ in keys], dtype=np.int64)
    drafts, counts = d.propose_many(keys, ks)
    assert drafts.dtype == np.int64 and counts.dtype == np.int64
    assert drafts.shape == (len(keys), int(ks.max()))
    for i, key in enumerate(keys):
        one = d.propose(key, int(ks[i])).tolist()
        assert counts[i] == len(one) <= ks[i]
        assert drafts[i, : counts[i]].tolist() == one
        assert not drafts[i, counts[i] :].any()
    empty, none = d.propose_many([], np.zeros(0, dtype=np.int64))
    assert empty.shape == (0, 0) and none.shape == (0,)
    with pytest.raises(ValueError, match="keys"):
        d.propose_many(keys, ks[:3])


def test_restart_replaces_state_and_finish_frees_it() -> None:
    d = NgramDrafter(2, 2)
    d.start(1, [1, 2, 3, 1, 2])
    assert d.propose(1, 5).tolist() == [3, 1, 2]
    d.start(1, [4, 5, 4])  # restart with other tokens: nothing of the old state survives
    d.check_integrity()
    assert d.propose(1, 5).tolist() == []
    d.append(1, [5])
    assert d.propose(1, 5).tolist() == [4, 5]
    d.finish(1)
    d.check_integrity()
    assert d.num_sequences == 0
    for call in (lambda: d.append(1, [1]), lambda: d.propose(1, 1), lambda: d.finish(1)):
        with pytest.raises(KeyError):
            call()


def test_memory_grows_with_tokens_only() -> None:
    # A repetition loop: a sequence's state is its tokens (one int32 matrix row, at most twice
    # as wide as the longest), and a proposal still reads k tokens after the earliest occurrence.
    d = NgramDrafter(2, 4)
    d.start(0, [1, 2, 3] * 2000)
    assert d._tokens.dtype == np.int32 and d._tokens.shape[1] <= 2 * 6000
    assert d.propose(0, 5).tolist() == [1, 2, 3, 1, 2]


def test_bad_lengths() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(4, 3)


@pytest.mark.parametrize("seed", range(10))
def test_batch_calls_match_brute_force_row_by_row(seed: int) -> None:
    """The engine's calls (append_many and propose_many over many keys at once, keys in any
    order, tokens past each row's count ignored) give each row exactly the brute-force
    lookup's drafts: n ranges of every width, vocabularies where most rows match and where many
    match nothing, sequences starting, restarting and finishing between steps."""
    rng = random.Random(1000 + seed)
    low = rng.randint(1, 3)
    high = rng.randint(low, 6)
    vocab = [2, 5, 12][seed % 3]
    d = NgramDrafter(low, high)
    model: dict[int, list[int]] = {}
    matched = unmatched = 0
    for _ in range(40):
        for key in rng.sample(list(model), min(len(model), rng.randint(0, 2))):
            d.finish(key)
            del model[key]
        for _ in range(rng.randint(0, 4)):
            key = rng.randrange(10**9)  # keys are sparse, like sequence ids
            if key in model and rng.random() < 0.5:  # a restart with all its tokens
                prompt = model[key]
            else:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
            d.start(key, prompt)
            model[key] = list(prompt)
        d.check_integrity()
        if not model:
            continue
        keys = rng.sample(list(model), rng.randint(0, len(model)))
        width = rng.randint(1, high + 2)
        tokens = np.array([[rng.randrange(vocab) for _ in range(width)] for _ in keys])
        counts = np.array([rng.randint(0, width) for _ in keys], dtype=np.int64)
        d.append_many(np.array(keys, dtype=np.int64), tokens.reshape(len(keys), width), counts)
        for key, row, n in zip(keys, tokens.tolist(), counts.tolist(), strict=True):
            model[key] += row[:n]
        d.check_integrity()
        keys = rng.sample(list(model), len(model))
        ks = np.array([rng.randint(-1, 7) for _ in keys], dtype=np.int64)
        drafts, got = d.propose_many(np.array(keys, dtype=np.int64), ks)
        assert drafts.shape == (len(keys), max(int(ks.max()), 0))
        for i, key in enumerate(keys):
            want = reference(model[key], low, high, int(ks[i]))
            assert drafts[i, : got[i]].tolist() == want, (seed, key, int(ks[i]))
            assert got[i] == len(want) and not drafts[i, got[i] :].any()
            if ks[i] > 0:
                matched += bool(want)
                unmatched += not want
    assert matched and unmatched  # both kinds of rows were drafted for


def test_append_many_checks_its_keys() -> None:
    d = NgramDrafter(1, 2)
    d.start(3, [1, 2])
    with pytest.raises(KeyError, match="sequence 4"):
        d.append_many(np.array([3, 4]), np.zeros((2, 1), dtype=np.int64), np.ones(2, np.int64))
    with pytest.raises(KeyError, match="sequence 4"):
        d.propose_many([4], np.array([2]))
    assert d.propose(3, 2).tolist() == []  # the failed call appended nothing
