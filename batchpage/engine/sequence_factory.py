"""Makes the sequences of a request: their ids, sampling seeds, stop checkers and, for a
request with structured_outputs, each sequence's own grammar matcher."""

from __future__ import annotations

from collections.abc import Collection

from batchpage.engine.constraint import Constraint
from batchpage.engine.reasoning import Phase, ReasoningMarkers, ThinkingTracker, prompt_phase
from batchpage.engine.sequence import PendingForks, Request, Sequence
from batchpage.engine.stop_checker import StopChecker
from batchpage.model.tokenizer import Tokenizer


def sequence_seed(request_seed: int | None, engine_seed: int, index: int, sample: int) -> int:
    """A sample's randomness depends on its request's seed (or the engine seed and the request's
    position) and its sample index only, never on what else runs in the batch."""
    base = request_seed if request_seed is not None else engine_seed * 1_000_003 + index
    return (base * 6_364_136_223_846_793_005 + sample * 1_442_695_040_888_963_407) % 2**63


class SequenceFactory:
    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_ids: Collection[int],
        max_model_len: int,
        seed: int,
        reasoning: ReasoningMarkers | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.seed = seed
        self.reasoning = reasoning  # the engine's reasoning parser, resolved; None: off
        self._next_id = 0

    def _is_blank(self, token_id: int) -> bool:
        return not self.tokenizer.decode([token_id], skip_special_tokens=False).strip()

    def _thinking(self, req: Request) -> ThinkingTracker | None:
        """The tracker of a sequence of req; None when there is no thinking to follow."""
        if self.reasoning is None:
            return None
        phase = prompt_phase(self.reasoning, req.prompt_token_ids, self._is_blank)
        if phase is Phase.ANSWER:
            return None
        return ThinkingTracker(self.reasoning, phase, req.params.thinking_token_budget)

    def make(self, req: Request, sample_index: int) -> Sequence:
        """A fresh sequence for one sample of req, holding its prompt and no blocks."""
        params = req.params
        constraint = None
        if params.structured_outputs is not None:
            if req.grammar is None:
                raise ValueError(f"request {req.index} has structured_outputs but no grammar")
            constraint = Constraint(
                req.grammar,
                stop_token_ids={*self.eos_ids, *params.stop_token_ids},
                stops=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            # Stop strings are the constraint's to check: it knows where the output may end.
            params = params.replace(stop=[])
        thinking = self._thinking(req)
        seq = Sequence(
            seq_id=self._next_id,
            request=req,
            sample_index=sample_index,
            token_ids=list(req.prompt_token_ids),
            seed=sequence_seed(params.seed, self.seed, req.index, sample_index),
            stop=StopChecker(
                self.tokenizer.decoder(params.skip_special_tokens),
                params,
                self.eos_ids,
                prompt_len=len(req.prompt_token_ids),
                max_model_len=self.max_model_len,
                # A few prompt tokens as context keep the first output token's leading space.
                context_ids=req.prompt_token_ids[-4:],
                stream_text=constraint is not None and constraint.has_stops,
                # A thinking output's text (the answer) opens when its thinking ends.
                text_open=thinking is None,
            ),
        )
        for state in (constraint, thinking):
            if state is not None:
                seq.attach(state)
        if req.params.prompt_logprobs is not None:
            seq.result.prompt_logprobs = [None]  # the first prompt token has nothing before it
        self._next_id += 1
        return seq

    def for_request(self, req: Request, share_prompt: bool) -> list[Sequence]:
        """With share_prompt, one sequence prefills the prompt and the other n - 1 samples are
        forked from it when it is done (they share its blocks); otherwise n independent ones."""
        if share_prompt and req.params.n > 1:
            parent = self.make(req, 0)
            parent.attach(PendingForks(list(range(1, req.params.n))))
            return [parent]
        return [self.make(req, i) for i in range(req.params.n)]
