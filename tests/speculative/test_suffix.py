"""SuffixDrafter and its SuffixAutomaton against brute force: occurrence counts of every
substring, and proposals computed plainly from the definition in suffix.py's docstring (every
match length tried, every continuation counted by scanning every document), over random
start/append/propose/finish/restart runs on small vocabularies with check_integrity after every
operation; the cache's bounds and eviction order; restart after preemption; freed state."""

from __future__ import annotations

import gc
import random
import weakref
from collections import Counter

import numpy as np
import pytest

from batchpage.speculative.suffix import SuffixDrafter
from batchpage.speculative.suffix_automaton import Cursor, SuffixAutomaton

# ---- the reference -----------------------------------------------------------------------------


def continuations(docs: list[list[int]], context: list[int]) -> Counter[int]:
    """For each token t, how often context + t occurs in the documents."""
    n = len(context)
    found: Counter[int] = Counter()
    for doc in docs:
        for i in range(len(doc) - n):
            if doc[i : i + n] == context:
                found[doc[i + n]] += 1
    return found


def reference_draft(
    tokens: list[int],
    doc_sets: list[list[list[int]]],
    k: int,
    depth: int,
    factor: float,
    min_prob: float,
) -> list[int]:
    best: list[int] = []
    best_score = 0.0
    for docs in doc_sets:
        set_best: list[int] = []
        set_score = 0.0
        for m in range(1, min(len(tokens), depth - 1) + 1):
            context = tokens[len(tokens) - m :]
            cap = min(k, int(factor * m + 1e-6), depth - m)
            prob, score, out = 1.0, 0.0, []
            while len(out) < cap:
                found = continuations(docs, context + out)
                if not found:
                    break
                total = sum(found.values())
                t = min(found, key=lambda tok: (-found[tok], tok))
                prob *= found[t] / total
                if prob < min_prob:
                    break
                out.append(t)
                score += prob
            if score >= set_score:  # ties: the longer match
                set_best, set_score = out, score
        if set_score > best_score:  # ties: the earlier set
            best, best_score = set_best, set_score
    return best


class CacheModel:
    """The cache's documented rule, plainly: at most two generations, a new one begun when the
    newest holds half a budget, the oldest dropped until a new output fits both budgets."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.generations: list[list[list[int]]] = []

    def add(self, output: list[int]) -> None:
        if not output or self.max_requests == 0:
            return
        doc = output[: self.max_tokens]
        gens = self.generations
        while gens and (
            sum(map(len, gens)) + 1 > self.max_requests
            or sum(len(d) for g in gens for d in g) + len(doc) > self.max_tokens
        ):
            gens.pop(0)
        if not gens or (
            2 * len(gens[-1]) >= self.max_requests or 2 * sum(map(len, gens[-1])) >= self.max_tokens
        ):
            gens.append([])
            if len(gens) > 2:
                gens.pop(0)
        gens[-1].append(doc)


# ---- the automaton -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_automaton_counts_every_substring(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(1, 7)
    vocab = rng.choice([1, 2, 3, 4])
    sam = SuffixAutomaton(depth)
    docs: list[list[int]] = []
    cursors: list[Cursor] = []
    for _ in range(60):  # documents grow interleaved, as running sequences do
        if not docs or rng.random() < 0.2:
            docs.append([])
            cursors.append(Cursor())
        i = rng.randrange(len(docs))
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        sam.extend(cursors[i], new)
        docs[i].extend(new)
        sam.check_integrity(docs)
        window = docs[i][-depth:]
        state, n = sam.match(window)
        assert n == len(window) and state == cursors[i].deep
    assert sam.num_states <= 2 * sam.num_tokens + 1


def test_automaton_match_is_the_longest_present_suffix() -> None:
    sam = SuffixAutomaton(8)
    sam.extend(Cursor(), [1, 2, 3, 4])
    sam.extend(Cursor(), [5, 2, 3])
    assert sam.match([9, 9, 2, 3])[1] == 2
    assert sam.match([1, 2, 3])[1] == 3
    assert sam.match([3, 5])[1] == 1  # "3 5" never occurs; "5" does
    assert sam.match([7])[1] == 0
    with pytest.raises(ValueError, match="max_depth"):
        SuffixAutomaton(0)


def test_repetition_loop_stays_linear() -> None:
    # A degenerate loop makes long link chains; states stay at most two per token and the
    # counts of short contexts exact.
    sam = SuffixAutomaton(6)
    doc = [1, 2] * 300
    sam.extend(Cursor(), doc)
    assert sam.num_states <= 2 * len(doc) + 1
    sam.check_integrity([doc])


# ---- the drafter -------------------------------------------------------------------------------


def drafter(
    max_tree_depth: int = 8,
    max_cached_requests: int = 10,
    max_spec_factor: float = 1.0,
    min_token_prob: float = 0.1,
    **kw: int,
) -> SuffixDrafter:
    return SuffixDrafter(
        max_tree_depth=max_tree_depth,
        max_cached_requests=max_cached_requests,
        max_spec_factor=max_spec_factor,
        min_token_prob=min_token_prob,
        **kw,
    )


def test_copies_the_prompt_and_scores_the_cache() -> None:
    d = drafter()
    d.start(0, [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    # "1 2 3" occurred once, followed by 4 5 6 9...: factor 1 caps the draft at 3 tokens.
    assert d.propose(0, 10).tolist() == [4, 5, 6]
    d.append(0, [4, 5, 7])
    d.finish(0)  # its output 4 5 7 joins the cache
    d.start(1, [8, 4, 5])
    # Own tokens: nothing; cache: "4 5" -> 7 (prob 1), then the output ends.
    assert d.propose(1, 4).tolist() == [7]
    d.check_integrity()


@pytest.mark.parametrize("seed", range(16))
def test_random_runs_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(1, 7)
    factor = rng.choice([0.5, 1.0, 2.0])
    min_prob = rng.choice([0.0, 0.1, 0.4])
    max_requests = rng.choice([0, 1, 2, 3, 6])
    max_tokens = rng.choice([5, 20, 1000])
    vocab = rng.choice([2, 3, 4])
    d = drafter(depth, max_requests, factor, min_prob, max_cached_tokens=max_tokens)
    cache = CacheModel(max_requests, max_tokens)
    seqs: dict[int, tuple[list[int], int]] = {}  # key -> (tokens, prompt length)
    next_key = 0
    finished: list[list[int]] = []
    for _ in range(250):
        op = rng.random()
        if op < 0.12 or not seqs:
            key, next_key = next_key, next_key + 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            d.start(key, prompt)
            seqs[key] = (list(prompt), len(prompt))
        elif op < 0.5:
            key = rng.choice(list(seqs))
            tokens, _ = seqs[key]
            if tokens and rng.random() < 0.5:  # copy a stretch of itself: matches happen
                at = rng.randrange(len(tokens))
                new = tokens[at : at + rng.randint(1, 4)]
            else:
                new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            d.append(key, new)
            tokens.extend(new)
        elif op < 0.8:
            key = rng.choice(list(seqs))
            k = rng.randint(0, 6)
            sets = [[seqs[key][0]], *reversed(cache.generations)]
            expected = reference_draft(seqs[key][0], sets, k, depth, factor, min_prob)
            assert d.propose(key, k).tolist() == expected, (seed, key, k)
        elif op < 0.93:
            key = rng.choice(list(seqs))
            tokens, prompt_len = seqs.pop(key)
            d.finish(key)
            cache.add(tokens[prompt_len:])
            finished.append(tokens[prompt_len:][:max_tokens])
        else:  # restart after preemption: everything so far is the prompt; the boundary stays
            key = rng.choice(list(seqs))
            d.start(key, seqs[key][0])
        d.check_integrity()
        assert d.num_sequences == len(seqs)
        cached = d.cached_outputs
        assert cached == [doc for g in cache.generations for doc in g]
        # Bounds, and eviction oldest first: the cache is always the latest outputs, in order.
        assert len(cached) <= max_requests and d.num_cached_tokens <= max_tokens
        nonempty = [doc for doc in finished if doc]
        assert cached == (nonempty[len(nonempty) - len(cached) :] if cached else [])


def test_propose_many_matches_propose() -> None:
    rng = random.Random(7)
    d = drafter(max_tree_depth=6, max_cached_requests=4)
    for key in range(6):
        d.start(key, [rng.randrange(3) for _ in range(20)])
        d.append(key, [rng.randrange(3) for _ in range(10)])
    d.finish(5)
    keys = [4, 0, 3, 1, 2]
    ks = np.array([3, 0, 5, 1, 4])
    drafts, counts = d.propose_many(keys, ks)
    assert drafts.shape == (5, 5) and drafts.dtype == np.int64 and counts.dtype == np.int64
    for i, key in enumerate(keys):
        one = d.propose(key, int(ks[i])).tolist()
        assert counts[i] == len(one) <= ks[i]
        assert drafts[i, : counts[i]].tolist() == one and not drafts[i, counts[i] :].any()


def test_append_many_is_append_key_by_key() -> None:
    """The engine's batch call (tokens past each row's count ignored) leaves the drafter as
    the same appends one key at a time: the same automata, the same drafts."""
    rng = random.Random(8)
    many, one = drafter(max_tree_depth=6), drafter(max_tree_depth=6)
    for key in range(5):
        prompt = [rng.randrange(3) for _ in range(rng.randint(0, 15))]
        many.start(10 * key, prompt)
        one.start(10 * key, prompt)
    for _ in range(6):
        keys = np.array(rng.sample(range(0, 50, 10), rng.randint(0, 5)), dtype=np.int64)
        tokens = np.array([[rng.randrange(3) for _ in range(4)] for _ in keys], dtype=np.int64)
        counts = np.array([rng.randint(0, 4) for _ in keys], dtype=np.int64)
        many.append_many(keys, tokens.reshape(len(keys), 4), counts)
        for key, row, n in zip(keys.tolist(), tokens.tolist(), counts.tolist(), strict=True):
            one.append(key, row[:n])
        many.check_integrity()
        for key in range(0, 50, 10):
            assert many.propose(key, 5).tolist() == one.propose(key, 5).tolist()
    with pytest.raises(KeyError):
        many.append_many(np.array([3]), np.zeros((1, 1), dtype=np.int64), np.ones(1, np.int64))


def test_restart_keeps_the_prompt_boundary() -> None:
    d = drafter(max_tree_depth=6, max_cached_requests=5)
    d.start(3, [1, 2, 3])
    d.append(3, [4, 5])
    d.start(3, [1, 2, 3, 4, 5])  # preempted and resumed: its tokens so far as the prompt
    d.append(3, [6])
    d.check_integrity()
    d.finish(3)
    assert d.cached_outputs == [[4, 5, 6]]
    d.start(4, [1, 2])
    d.start(4, [9, 9, 9])  # not a continuation of the old prompt: a new sequence
    d.append(4, [7])
    d.finish(4)
    assert d.cached_outputs == [[4, 5, 6], [7]]


def test_finish_frees_the_sequence_and_the_cache_holds_its_bounds() -> None:
    d = drafter(max_tree_depth=8, max_cached_requests=4, max_cached_tokens=50)
    d.start(0, list(range(30)))
    automaton = weakref.ref(d._running[0].sam)
    d.append(0, [1, 2, 3])
    d.finish(0)
    gc.collect()
    assert automaton() is None and d.num_sequences == 0
    for key in range(1, 40):
        d.start(key, [key])
        d.append(key, [key % 5] * (key % 13 + 1))
        d.finish(key)
        d.check_integrity()
        assert len(d.cached_outputs) <= 4 and d.num_cached_tokens <= 50
        assert len(d.cached_outputs) >= 1  # eviction keeps the newest
    for call in (lambda: d.append(0, [1]), lambda: d.propose(0, 1), lambda: d.finish(0)):
        with pytest.raises(KeyError):
            call()


def test_no_cache_and_no_depth() -> None:
    d = drafter(max_tree_depth=5, max_cached_requests=0)
    d.start(0, [1, 2])
    d.append(0, [3])
    d.finish(0)
    assert d.cached_outputs == []
    shallow = drafter(max_tree_depth=1)
    shallow.start(0, [1, 1, 1, 1])
    assert shallow.propose(0, 4).tolist() == []  # no room for a match and a draft


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_tree_depth"):
        drafter(max_tree_depth=0)
    with pytest.raises(ValueError, match="min_token_prob"):
        drafter(min_token_prob=1.5)
