"""Requests (what the user asked) and sequences (what the scheduler runs).

A request with n samples runs as n sequences. A sequence's tokens are its prompt followed by what
it generated; `num_computed_tokens` of them have their K/V in the pool, through `block_table`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch

from batchpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from batchpage.engine.pooled_states import PoolingType
    from batchpage.engine.sampler import TopLogprobs
    from batchpage.engine.stop_checker import StopChecker
    from batchpage.lora.request import LoRARequest
    from batchpage.model.image_prompt import PromptImage
    from batchpage.model.mrope import PromptPositions


@dataclass(eq=False)
class Request:
    index: int  # position in the caller's input; outputs come back in this order
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    error: str | None = None  # set for a bad request: it gets no sequence and no completion
    grammar: CompiledGrammar | None = None  # params.structured_outputs compiled (GrammarCache)
    # A pooling model's request (embed, classify, ...): it finishes when its prompt is computed,
    # with no token sampled; None: a generation request.
    pooling: PoolingType | None = None
    # The LoRA adapter it runs with; None: the base model.
    lora: LoRARequest | None = None
    # Its images, in prompt order: each one's encoder rows replace the token embeddings at its
    # positions, and its content key replaces those tokens in the prefix cache's key.
    images: tuple[PromptImage, ...] = ()
    # An M-RoPE model's 3-D positions of its prompt, which has images (model/mrope.py; set by
    # Engine.add_requests); None: its positions are p + 0 on every axis.
    mrope: PromptPositions | None = None


T = TypeVar("T")


class RowHome(Protocol):
    """Where a running sequence's computed count and new tokens live: its row of the input
    batch (engine/input_batch.py)."""

    computed: np.ndarray
    num_tokens: np.ndarray

    def sync(self, row: int) -> None: ...

    def append_tokens(self, rows: np.ndarray, tokens: list[int] | np.ndarray) -> None: ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, never run: its first admission is still to come
    RUNNING = "running"
    PREEMPTED = "preempted"  # queued again after it ran (its blocks given back or swapped out)
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SeqResult:
    """What a sequence produced, for the API and the job to read (llm.py's _request_output,
    llm_pooling.py): filled by the step's commit (engine/commit.py) as the sequence runs, or at
    once by a beam search for its results (beam_steps.py). `finish_reason` is None while it
    runs."""

    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    text: str = ""  # its output's text (the answer, after any thinking)
    logprobs: list[TopLogprobs] | None = None  # one per output token, with params.logprobs
    # With params.prompt_logprobs: None for the first prompt token, then one per token scored so
    # far (a preempted sequence's recompute scores none twice).
    prompt_logprobs: list[TopLogprobs | None] | None = None
    cumulative_logprob: float | None = None  # a beam-search result's tokens' logprobs summed
    # A pooling request's output: the model's head on the pooled vector (pooled_states.py).
    pooled: torch.Tensor | None = None


@dataclass(eq=False, slots=True)
class PendingForks:
    """Attached to the one sequence that prefills an n > 1 request's prompt for all of its
    samples (SequenceFactory.for_request): the sample indices still to fork from it once its
    prompt is computed. The commit detaches it when the last one is forked."""

    indices: list[int]


class Sequence:
    """What the scheduler runs: one sample of a request. While it runs it holds a row of the
    input batch (input_batch.py), which is then the one home of its computed count and of the
    tokens it takes each step: `num_computed_tokens`, `num_tokens` and `token_ids` read through
    the row (the tokens taken since the last read are moved into the list on that read), and a
    token is appended with `append_token` (the engine appends a whole step's with
    InputBatch.append_tokens), never to the list itself.

    It holds its identity (request, sample index, seed), its tokens (the request's prompt, then
    its own), its scheduling state (computed count, blocks, status, row) and its stop checker;
    what it produced is its `result` (SeqResult). A feature's own state is attached by the
    feature (`attach`, `feature`: structured outputs' Constraint, reasoning's ThinkingTracker,
    pooling's PoolSum, the samples still to fork (PendingForks), a swapped-out preemption's
    K/V (scheduler.SwappedOut)), never a field here; the batch's row flags tell a step which
    rows need it."""

    __slots__ = (
        "seq_id", "request", "sample_index", "_tokens", "seed", "stop", "_computed",
        "num_cached_tokens", "block_table", "status", "result", "batch", "row", "_features",
    )  # fmt: skip

    def __init__(
        self,
        seq_id: int,
        request: Request,
        sample_index: int,
        token_ids: list[int],
        seed: int,
        stop: StopChecker,
    ) -> None:
        """`token_ids`: its own copy of the request's prompt."""
        assert len(token_ids) == len(request.prompt_token_ids), "a sequence starts at its prompt"
        self.seq_id = seq_id
        self.request = request
        self.sample_index = sample_index
        self._tokens = token_ids
        self.seed = seed  # its sampled tokens' draws are keyed by it (sampler.draw_keys)
        self.stop = stop
        self._computed = 0  # while it holds no row; then the row's
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.result = SeqResult()
        self._features: dict[type, object] = {}
        # The input batch and row it holds while it runs (InputBatch.join / leave).
        self.batch: RowHome | None = None
        self.row = -1

    def attach(self, state: object) -> None:
        """Attach a feature's state for this sequence (at most one of each type)."""
        self._features[type(state)] = state

    def feature(self, kind: type[T]) -> T | None:
        """The attached state of type `kind`; None when the feature does not follow it."""
        return self._features.get(kind)  # type: ignore[return-value]

    def detach(self, kind: type) -> None:
        self._features.pop(kind, None)

    @property
    def plain_greedy(self) -> bool:
        """Its token is the argmax of the raw logits (the row flag the sampler reads), but on a
        step that forces its end of thinking (ThinkingTracker.forced_token)."""
        params = self.request.params
        return params.is_plain_greedy and params.structured_outputs is None

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, {self.num_tokens} tokens)"

    @property
    def token_ids(self) -> list[int]:
        """Prompt and generated tokens. Read it, never append to it: see append_token."""
        if self.batch is not None:
            self.batch.sync(self.row)
        return self._tokens

    @token_ids.setter
    def token_ids(self, tokens: list[int]) -> None:
        assert self.batch is None, "a running sequence's tokens change through its row"
        self._tokens = tokens

    def append_token(self, token: int) -> None:
        if self.batch is not None:
            self.batch.append_tokens(np.array([self.row]), [token])
        else:
            self._tokens.append(token)

    @property
    def num_computed_tokens(self) -> int:
        batch = self.batch
        return self._computed if batch is None else int(batch.computed[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:
        batch = self.batch
        if batch is None:
            self._computed = n
        else:
            batch.computed[self.row] = n

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt_tokens(self) -> int:
        """Its prompt's length: every sequence of a request starts from the request's prompt
        (forked samples and beams too: SequenceFactory.make)."""
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        batch = self.batch
        return len(self._tokens) if batch is None else int(batch.num_tokens[self.row])

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def reads_every_prompt_row(self) -> bool:
        """Whether the output of every prompt position is needed (prompt logprobs; MEAN or CLS
        pooling): such a sequence borrows no cached prefix."""
        pooling = self.request.pooling
        return self.params.prompt_logprobs is not None or (
            pooling is not None and pooling.reads_every_row
        )

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Whether its next computed tokens are a prefill: its prompt is not all computed, or
        more than its newest token waits (what a preempted sequence recomputes). A decode row
        has only its newest token to compute, however many a step may give it."""
        computed = self.num_computed_tokens
        return computed < self.num_prompt_tokens or computed < self.num_tokens - 1
