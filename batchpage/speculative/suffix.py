"""SuffixDrafter: suffix decoding (Arctic Inference's, vLLM's "suffix" method) over each
sequence's own tokens and the outputs of the job's finished sequences.

Statistics. Two kinds of document sets, each a SuffixAutomaton (suffix_automaton.py, which says
why that structure): a running sequence's own tokens (prompt and output so far), freed at
finish; and the job-wide cache of finished sequences' outputs (their prompts are not cached: a
row's prompt is in its own set, and outputs are what rows repeat across a job), at most
max_cached_requests outputs and max_cached_tokens tokens. For a context x and token t,
count(x + t) is the number of occurrences of x + t in a set, and t's estimated probability after
x is count(x + t) / sum over t' of count(x + t') (occurrences of x that end a document, such as
the sequence's own last tokens, continue nowhere and do not count).

A proposal for a sequence with tokens S and a draft size k, in each set (own tokens first, then
the cached outputs, newest generation first) and for each match length m from 1 to
min(len(S), max_tree_depth - 1) whose context P = S[-m:] occurs with a continuation in the set:
starting from x = P and prob = 1, repeatedly take the most frequent continuation t of x (ties:
the smallest token id), prob *= its probability, stop before a token whose prob falls below
min_token_prob, else draft it and x = x + t; at most min(k, floor(max_spec_factor * m + 1e-6),
max_tree_depth - m) tokens. A draft's score is the sum of its tokens' probs; the highest score
wins, ties going to the longer match, then to the earlier set. That is Arctic Inference's rule
(SuffixTree::speculate over match lengths, path mode), except for the probability's denominator
noted above and that an output joins the cache when its sequence finishes, not while it runs.
Trying every match length, not only the longest, matters: a long match leaves little depth to
draft in, and a short one's counts may predict further.

Cost. A token appended costs the automaton amortized O(1) plus one count per short-suffix class
(suffix_automaton.py). A proposal matches the last max_tree_depth - 1 tokens against each cache
generation (O(max_tree_depth) each), then walks one draft per distinct match class, skipping
those whose cap cannot beat the best score so far; each walk step scans the continuations of
its context. None of it grows with the sequence's length.

Cache eviction drops the oldest documents a generation at a time: outputs go into the newest of
at most two automata, a new one is begun when it holds half the request or token budget, and
beginning a third drops the oldest; before adding, the oldest generations go until the new
output fits both budgets, so the bounds always hold and about half the cache survives an
eviction. A sequence's output is what follows its prompt: `prompt_len` tokens where start is
told, else the tokens given at its first start (a restart after preemption whose tokens extend
them keeps that boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from batchpage.speculative.drafter import append_each, drafts_array, token_list
from batchpage.speculative.suffix_automaton import ROOT, Cursor, SuffixAutomaton

# The job-wide cache's default token budget. Its memory is linear in it (at most two automaton
# states per token, each a small dict and three list slots), and small beside the KV cache the
# same tokens take.
DEFAULT_MAX_CACHED_TOKENS = 1 << 18


@dataclass(slots=True)
class _Running:
    tokens: list[int]
    prompt_len: int
    sam: SuffixAutomaton
    cursor: Cursor


@dataclass(slots=True)
class _Generation:
    sam: SuffixAutomaton
    docs: list[list[int]] = field(default_factory=list)
    num_tokens: int = 0


class SuffixDrafter:
    def __init__(
        self,
        *,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
    ) -> None:
        """The options are speculative_config's suffix_decoding_* (config.py has their meanings
        and vLLM's defaults); max_cached_tokens is batchpage's own bound on the cache."""
        if max_tree_depth < 1 or max_cached_requests < 0 or max_cached_tokens < 1:
            raise ValueError(
                "suffix drafter needs max_tree_depth >= 1, max_cached_requests >= 0 and "
                f"max_cached_tokens >= 1; got {max_tree_depth}, {max_cached_requests}, "
                f"{max_cached_tokens}"
            )
        if not (max_spec_factor >= 0 and 0 <= min_token_prob <= 1):
            raise ValueError(
                "suffix drafter needs max_spec_factor >= 0 and min_token_prob in [0, 1]; got "
                f"{max_spec_factor}, {min_token_prob}"
            )
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_tokens = max_cached_tokens
        # The most tokens a match of m tokens may draft, before k: the spec factor's bound (1e-6
        # so that e.g. 0.5 * 6 is 3 despite rounding) and the depth left after the match.
        self._caps = [
            min(int(max_spec_factor * m + 1e-6), max_tree_depth - m) for m in range(max_tree_depth)
        ]
        self._running: dict[int, _Running] = {}
        self._generations: list[_Generation] = []  # oldest first, at most two

    @property
    def num_sequences(self) -> int:
        return len(self._running)

    @property
    def cached_outputs(self) -> list[list[int]]:
        """The cached outputs, oldest first."""
        return [doc for g in self._generations for doc in g.docs]

    @property
    def num_cached_tokens(self) -> int:
        return sum(g.num_tokens for g in self._generations)

    # ---- the contract -------------------------------------------------------------------------

    def start(
        self, key: int, prompt_token_ids: Sequence[int], prompt_len: int | None = None
    ) -> None:
        tokens = token_list(prompt_token_ids)
        if prompt_len is None:
            prompt_len = len(tokens)
            old = self._running.get(key)
            if old is not None and tokens[: old.prompt_len] == old.tokens[: old.prompt_len]:
                prompt_len = old.prompt_len  # a restart: its output began there
        sam = SuffixAutomaton(self.max_tree_depth)
        cursor = Cursor()
        sam.extend(cursor, tokens)
        self._running[key] = _Running(tokens, prompt_len, sam, cursor)

    def append(self, key: int, tokens: Sequence[int]) -> None:
        r = self._get(key)
        new = token_list(tokens)
        r.tokens.extend(new)
        r.sam.extend(r.cursor, new)

    def append_many(self, keys: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        # Per key: an automaton grows one token at a time through data-dependent suffix-link
        # walks over dict transitions, which do not run in lockstep over rows.
        append_each(self.append, keys, tokens, counts)

    def propose(self, key: int, k: int) -> np.ndarray:
        return np.array(self._draft(key, k), dtype=np.int64)

    def propose_many(
        self, keys: Sequence[int] | np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        return drafts_array(self._draft, keys, k)

    def finish(self, key: int, token_ids: Sequence[int] | None = None) -> None:
        r = self._get(key)
        del self._running[key]
        tokens = r.tokens if token_ids is None else token_list(token_ids)
        self.learn(tokens[r.prompt_len :])

    def drop(self, key: int) -> None:
        self._get(key)
        del self._running[key]

    def learn(self, output_token_ids: Sequence[int]) -> None:
        output = token_list(output_token_ids)
        if output and self.max_cached_requests > 0:
            self._cache(output)

    # ---- drafting -----------------------------------------------------------------------------

    def _get(self, key: int) -> _Running:
        r = self._running.get(key)
        if r is None:
            raise KeyError(f"suffix drafter: sequence {key} was not started")
        return r

    def _draft(self, key: int, k: int) -> list[int]:
        r = self._get(key)
        context = min(len(r.tokens), self.max_tree_depth - 1)
        if k <= 0 or context <= 0:
            return []
        best: list[int] = []
        best_score = 0.0
        caps = self._caps
        own = r.sam.suffix_state(r.cursor, context)
        candidates = [(r.sam, own, context)]
        window = r.tokens[-context:]
        for g in reversed(self._generations):
            state, n = g.sam.match(window)
            if n:
                candidates.append((g.sam, state, n))
        for sam, state, n in candidates:
            # The link chain from `state` holds the contexts S[-m:] for m = n down to 1; all
            # lengths in one state share one continuation, so one walk per state, sized by the
            # longest cap among its lengths.
            length, link = sam.length, sam.link
            while state != ROOT:
                low = length[link[state]] + 1
                cap = min(k, max(caps[low : n + 1]))
                if cap > best_score:  # a draft's score is at most its length
                    draft, score = self._walk(sam, state, cap)
                    if score > best_score:
                        best, best_score = draft, score
                state, n = link[state], low - 1
        return best

    def _walk(self, sam: SuffixAutomaton, state: int, cap: int) -> tuple[list[int], float]:
        nxt, count = sam.next, sam.count
        prob, score, out = 1.0, 0.0, []
        while len(out) < cap:
            total, top, top_token, top_state = 0, 0, -1, ROOT
            for t, u in nxt[state].items():
                c = count[u]
                total += c
                if c > top or (c == top and t < top_token):
                    top, top_token, top_state = c, t, u
            if total == 0:
                break
            prob *= top / total
            if prob < self.min_token_prob:
                break
            out.append(top_token)
            score += prob
            state = top_state
        return out, score

    # ---- the job-wide cache -------------------------------------------------------------------

    def _cache(self, output: list[int]) -> None:
        doc = output[: self.max_cached_tokens]
        gens = self._generations
        while gens and (
            sum(len(g.docs) for g in gens) + 1 > self.max_cached_requests
            or sum(g.num_tokens for g in gens) + len(doc) > self.max_cached_tokens
        ):
            gens.pop(0)
        if not gens or self._full(gens[-1]):
            gens.append(_Generation(SuffixAutomaton(self.max_tree_depth)))
            if len(gens) > 2:
                gens.pop(0)
        g = gens[-1]
        g.sam.extend(Cursor(), doc)
        g.docs.append(doc)
        g.num_tokens += len(doc)

    def _full(self, g: _Generation) -> bool:
        return (
            2 * len(g.docs) >= self.max_cached_requests
            or 2 * g.num_tokens >= self.max_cached_tokens
        )

    def check_integrity(self) -> None:
        """Every running sequence's automaton holds exactly its tokens, the cache's automata
        exactly their outputs, and the cache keeps its bounds (brute force, for tests)."""
        for key, r in self._running.items():
            assert 0 <= r.prompt_len <= len(r.tokens), f"sequence {key}: bad prompt length"
            assert r.cursor.size == len(r.tokens), f"sequence {key}: cursor is stale"
            r.sam.check_integrity([r.tokens])
            state, n = r.sam.match(r.tokens[max(0, len(r.tokens) - self.max_tree_depth) :])
            assert n == min(len(r.tokens), self.max_tree_depth), f"sequence {key}: bad match"
            assert state == r.cursor.deep, f"sequence {key}: deep state is stale"
        assert len(self._generations) <= 2, "more than two cache generations"
        docs = self.cached_outputs
        assert len(docs) <= self.max_cached_requests, "too many cached outputs"
        assert self.num_cached_tokens <= self.max_cached_tokens, "cache over its token budget"
        for g in self._generations:
            assert g.docs, "an empty cache generation"
            assert g.num_tokens == sum(len(d) for d in g.docs), "generation token count"
            g.sam.check_integrity(g.docs)
