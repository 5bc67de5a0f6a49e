"""Requests (what the user asked) and sequences (what the scheduler runs).

A request with n samples runs as n sequences. A sequence's tokens are its prompt followed by what
it generated; `num_computed_tokens` of them have their K/V in the pool, through `block_table`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from batchpage.engine.constraint import Constraint
    from batchpage.engine.pooling import PoolingType
    from batchpage.engine.reasoning import ThinkingTracker
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


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    sample_index: int
    token_ids: list[int]
    generator: torch.Generator | None
    stop: StopChecker
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    admitted_once: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    logprobs: list[TopLogprobs] | None = None
    # With params.prompt_logprobs: None for the first prompt token, then one entry per token.
    prompt_logprobs: list[TopLogprobs | None] | None = None
    cumulative_logprob: float | None = None  # a beam-search result's: its tokens' logprobs summed
    # Tokens whose K/V waits in host memory after a swap-out preemption (0: none).
    swapped_tokens: int = 0
    # Sample indices still to fork from this sequence once its prompt is computed (n > 1).
    pending_forks: list[int] = field(default_factory=list)
    # The grammar state of a request with structured_outputs; None when unconstrained.
    constraint: Constraint | None = None
    # With a reasoning parser, where the thinking ends and the answer begins; None when the
    # output is all answer (no parser, or a prompt that closed the thinking already).
    thinking: ThinkingTracker | None = None
    # Its token is the argmax of the raw logits (read every step, set once), but on a step
    # that forces its end of thinking (thinking.forced_token).
    plain_greedy: bool = field(init=False)
    # A pooling request's float32 running sum of the rows it reads (engine/pooling.py), then
    # its output: the model's head on the pooled vector.
    pool_total: torch.Tensor | None = None
    pooled: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        self.plain_greedy = self.request.params.is_plain_greedy and self.constraint is None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def reasoning(self) -> str | None:
        """The thinking's text (no markers); None when the output did not think."""
        if self.thinking is None:
            return None
        output = self.output_token_ids
        ids = self.thinking.reasoning_ids(output)
        if ids is None:
            return None
        if self.thinking.reasoning_end is None and self.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the EOS or stop token that ended it while thinking
        start = self.num_prompt_tokens + self.thinking.reasoning_start
        return self.stop.decode_span(self.token_ids[max(0, start - 4) : start], ids)

    @property
    def active_constraint(self) -> Constraint | None:
        """The constraint that masks this sequence's next token: none while it thinks."""
        if self.thinking is not None and not self.thinking.answer_may_start:
            return None
        return self.constraint

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
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Whether its next computed tokens are a prefill: its prompt is not all computed, or
        more than its newest token waits (what a preempted sequence recomputes). A decode row
        has only its newest token to compute, however many a step may give it."""
        computed = self.num_computed_tokens
        return computed < self.num_prompt_tokens or computed < len(self.token_ids) - 1
