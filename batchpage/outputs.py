"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


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
