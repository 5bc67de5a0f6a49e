"""Beam search with HF transformers' semantics, its beams sharing KV blocks copy-on-write.

BeamGroup is the bookkeeping of one request (pure: scores and token lists). beam_steps.py runs
groups inside the engine's steps: every live beam of a group decodes in the same step, each step's
survivors are forked from their parents (sharing all blocks; the partly filled last block is
copied when a second child writes into it) and the old beams are freed. A group is admitted
only when its worst case (`worst_case_blocks`) fits the pool, so beams are never preempted.

HF's rules (generation/utils.py `_beam_search`), reproduced: at each step the top
K = max(2, 1 + #eos) * W continuations over all beams by accumulated logprob; a continuation that
ends (EOS, or max length) and ranks among the first W is a finished hypothesis scored
sum_logprobs / generated_len ** length_penalty; the best W that do not end run on; stop when
early stopping allows it (True: W hypotheses; False: the best running beam cannot beat the worst
hypothesis at its current length; "never": nor at max length when length_penalty > 0).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from batchpage.engine.kv_manager import blocks_for
from batchpage.sampling_params import SamplingParams

NEG = -1.0e9  # HF's "impossible" score, kept so that ties and sums behave as they do there


def beam_max_len(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """The longest a beam of this request can grow, prompt included."""
    if params.max_tokens is None:
        return max_model_len
    return min(max_model_len, prompt_len + params.max_tokens)


def worst_case_blocks(
    params: SamplingParams, prompt_len: int, max_model_len: int, block_size: int
) -> int:
    """Every beam at its longest, each with one block of its own copied on write."""
    max_len = beam_max_len(params, prompt_len, max_model_len)
    return params.effective_beam_width * (blocks_for(max_len, block_size) + 1)


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens (EOS included when it ended the beam)
    score: float  # sum of logprobs / generated_len ** length_penalty
    cum_logprob: float  # the sum of its tokens' logprobs


@dataclass
class BeamChoice:
    parent: int  # index of the beam it extends, in the group's running order
    token: int
    score: float  # accumulated logprob


@dataclass
class BeamGroup:
    width: int
    prompt_len: int
    max_len: int  # prompt_len + max_tokens, capped by max_model_len
    eos_ids: Collection[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    scores: list[float] = field(default_factory=list)  # running beams' accumulated logprobs
    outputs: list[list[int]] = field(default_factory=list)  # running beams' generated tokens
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        # All beams start as the prompt; only the first counts, so step one picks from it alone.
        self.scores = [0.0] + [NEG] * (self.width - 1)
        self.outputs = [[] for _ in range(self.width)]

    @property
    def cur_len(self) -> int:
        return self.prompt_len + len(self.outputs[0])

    def step(self, logprobs: torch.Tensor) -> list[BeamChoice]:
        """logprobs: float32 [width, vocab], row b for running beam b (rows may be the same
        tensor row for beams that share a history). Returns the next running beams."""
        width, vocab = logprobs.shape
        assert width == self.width
        acc = logprobs + torch.tensor(self.scores, dtype=logprobs.dtype)[:, None]
        k = max(2, 1 + len(self.eos_ids)) * width
        top_scores, top_idx = acc.reshape(-1).topk(k)
        flat = zip(top_scores.tolist(), top_idx.tolist(), strict=True)
        cands = [(score, i // vocab, i % vocab) for score, i in flat]  # (acc logprob, beam, token)
        at_max = self.cur_len + 1 >= self.max_len
        hits = [at_max or tok in self.eos_ids for _, _, tok in cands]

        running = sorted(range(k), key=lambda j: -(cands[j][0] + (NEG if hits[j] else 0.0)))[:width]
        choices = [
            BeamChoice(cands[j][1], cands[j][2], cands[j][0] + (NEG if hits[j] else 0.0))
            for j in running
        ]

        # HF adds -1e9 to a hypothesis that may no longer count; it then never beats the empty
        # slots (-1e9), so such a hypothesis is simply not kept.
        closed = (len(self.finished) == width and self.early_stopping is True) or (
            not self.improvable
        )
        gen_len = self.cur_len + 1 - self.prompt_len
        new_hyps = [
            Hypothesis(self.outputs[beam] + [tok], score / gen_len**self.length_penalty, score)
            for (score, beam, tok), hit in zip(cands[:width], hits[:width], strict=True)
            if hit and not closed  # only the top W continuations may finish
        ]
        merged = self.finished + new_hyps
        merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties, as topk does
        self.finished = merged[:width]

        self.outputs = [self.outputs[c.parent] + [c.token] for c in choices]
        self.scores = [c.score for c in choices]
        self._update_done(all(hits))
        return choices

    def _update_done(self, no_continuation: bool) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_len - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_possible = self.scores[0] / best_len**self.length_penalty
        full = len(self.finished) == self.width
        worst = min(h.score for h in self.finished) if full else NEG
        self.improvable = self.improvable and best_possible > worst
        self.done = not self.improvable or (full and self.early_stopping is True) or no_continuation

    def best(self, n: int) -> list[Hypothesis]:
        """The n best hypotheses. HF fills missing ones from the empty slots; here a beam that
        never finished is closed at the end instead (see beam_steps.py)."""
        return self.finished[:n]
