"""What generate() and the pooling methods return, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompletionOutput:
    index: int  # the sample's index among the request's n
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: token id -> logprob
    # With a reasoning parser: the thinking, apart from `text` (then the answer only); None when
    # the output did not think.
    reasoning: str | None = None
    cumulative_logprob: float | None = None  # beam search: the output's logprobs summed


@dataclass
class BeamSearchSequence:
    """One beam of LLM.beam_search, vLLM's shape: the prompt's tokens then the beam's, and their
    text (special tokens kept, as vLLM decodes it)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str | None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """LLM.beam_search's answer for one prompt: its beams, best first; empty with `error`."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # With SamplingParams.prompt_logprobs: None for the first token, then token id -> logprob.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # a bad request: why it got no completion

    @property
    def finished(self) -> bool:
        return True


# Pooling models (LLM.embed / classify / score / reward), in vLLM's shapes. `error` is set for a
# bad request, whose output is then empty.


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # one per label, in id order (LLM.model_config.head.labels names them)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: torch.Tensor  # float32 [num_labels]: the head's raw outputs


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput | PoolingOutput | None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None

    @property
    def finished(self) -> bool:
        return True


# vLLM's names for each method's output.
EmbeddingRequestOutput = PoolingRequestOutput
ClassificationRequestOutput = PoolingRequestOutput
ScoringRequestOutput = PoolingRequestOutput
