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


T = TypeVar("T")


class RowHome(Protocol):
    """Where a running sequence's computed count and new tokens live: its row of the input
    batch (engine/input_batch.py)."""

    computed: np.ndarray
    num_tokens: np.ndarray

    def sync(self, row: int) -> None: ...

    def append_tokens(self, rows: np.ndarray, tokens: list[int] | np.ndarray) -> None: ...


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """What the scheduler runs: one sample of a request. While it runs it holds a row of the
    input batch (input_batch.py), which is then the one home of its computed count and of the
    tokens it takes each step: `num_computed_tokens`, `num_tokens` and `token_ids` read through
    the row (the tokens taken since the last read are moved into the list on that read), and a
    token is appended with `append_token` (the engine appends a whole step's with
    InputBatch.append_tokens), never to the list itself.

    It holds scheduling state and its results (text, finish reason, logprobs, pooled output).
    A feature's own state is attached by the feature (`attach`, `feature`: structured outputs'
    Constraint, reasoning's ThinkingTracker, pooling's PoolSum), never a field here; the batch's
    row flags tell a step which rows need it."""

    __slots__ = (
        "seq_id", "request", "sample_index", "_tokens", "seed", "stop",
        "num_prompt_tokens", "_computed", "num_cached_tokens", "block_table", "status",
        "admitted_once", "finish_reason", "stop_reason", "text", "logprobs", "prompt_logprobs",
        "cumulative_logprob", "swapped_tokens", "pending_forks", "pooled", "batch", "row",
        "_features",
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
        self.seq_id = seq_id
        self.request = request
        self.sample_index = sample_index
        self._tokens = token_ids
        self.seed = seed  # its sampled tokens' draws are keyed by it (sampler.draw_keys)
        self.stop = stop
        self.num_prompt_tokens = len(token_ids)
        self._computed = 0  # while it holds no row; then the row's
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.admitted_once = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.logprobs: list[TopLogprobs] | None = None
        # With params.prompt_logprobs: None for the first prompt token, then one per token.
        self.prompt_logprobs: list[TopLogprobs | None] | None = None
        # A beam-search result's: its tokens' logprobs summed.
        self.cumulative_logprob: float | None = None
        # Tokens whose K/V waits in host memory after a swap-out preemption (0: none).
        self.swapped_tokens = 0
        # Sample indices still to fork from this sequence once its prompt is computed (n > 1).
        self.pending_forks: list[int] = []
        # A pooling request's output: the model's head on the pooled vector (pooled_states.py).
        self.pooled: torch.Tensor | None = None
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
