"""LLM.embed / classify / score / reward: pooling models in vLLM's shapes.

The engine gives each request's pooled vector (engine/pooled_states.py): the hidden state for embed
and for score with an embedding model, the score head's outputs for classify, reward and score
with a cross-encoder. What each method makes of it is here: normalizing and Matryoshka
truncation, the label activation, the cosine of two embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from batchpage.engine.engine import Engine
from batchpage.engine.sequence import Request, Sequence
from batchpage.metrics import RunStats
from batchpage.model.config import ModelConfig
from batchpage.model.score_head import num_labels
from batchpage.model.tokenizer import Tokenizer
from batchpage.pooling_params import PoolingParams
from batchpage.prompt_list import as_prompt_list
from batchpage.request_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from batchpage.sampling_params import SamplingParams

# A pooling request computes its prompt and samples nothing: these params only size its blocks.
_PROMPT_ONLY = SamplingParams(temperature=0.0, max_tokens=1)
Output = EmbeddingOutput | ClassificationOutput | ScoringOutput | PoolingOutput


class PoolingMethods:
    """LLM's pooling methods (mixed into LLM). Each takes prompts as generate() does (text,
    token ids, or vLLM's prompt dicts) and returns one output per prompt, in input order; a
    bad prompt gets an output with `error` set and `outputs` None."""

    # LLM's, which these methods use.
    engine: Engine
    model_config: ModelConfig
    tokenizer: Tokenizer
    _make_request: Callable[..., Request]
    _run: Callable[..., list[Any]]
    _per_prompt_lora: Callable[[Any, int], list[Any]]

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        on_output: Callable[[PoolingRequestOutput, int], None] | None = None,
        on_step: Callable[[RunStats], None] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """The prompts' embeddings (task=embed): the pooled hidden state, truncated to
        pooling_params.dimensions and L2-normalized unless normalize=False."""
        params = pooling_params or PoolingParams()
        self._require_task("embed", ("embed",))
        return self._pool_prompts(
            prompts, params, use_tqdm, lambda v: _embedding(v, params), on_output, on_step,
            lora_request,
        )  # fmt: skip

    def classify(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        on_output: Callable[[PoolingRequestOutput, int], None] | None = None,
        on_step: Callable[[RunStats], None] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """Label probabilities (task=classify): softmax over the head's outputs (a sigmoid for
        one label) unless use_activation=False."""
        params = pooling_params or PoolingParams()
        self._require_task("classify", ("classify", "reward", "score"))
        activate = params.use_activation is not False

        def output(v: torch.Tensor) -> Output:
            return ClassificationOutput(_activation(v).tolist() if activate else v.tolist())

        return self._pool_prompts(
            prompts, params, use_tqdm, output, on_output, on_step, lora_request
        )

    def reward(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        on_output: Callable[[PoolingRequestOutput, int], None] | None = None,
        on_step: Callable[[RunStats], None] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """A reward model's outputs at the pooled position (task=reward): the head's raw
        values, activated only with use_activation=True."""
        params = pooling_params or PoolingParams()
        self._require_task("reward", ("classify", "reward", "score"))
        activate = params.use_activation is True
        return self._pool_prompts(
            prompts,
            params,
            use_tqdm,
            lambda v: PoolingOutput(_activation(v) if activate else v),
            on_output,
            on_step,
            lora_request,
        )

    def score(
        self,
        data_1: str | Seq[str],
        data_2: str | Seq[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        on_output: Callable[[PoolingRequestOutput, int], None] | None = None,
        on_step: Callable[[RunStats], None] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """Relevance of each (data_1, data_2) pair (task=score): one text against many, or
        pairwise. A cross-encoder (a classifier with one label) reads the pair as one prompt
        (the tokenizer's pair encoding) and gives the sigmoid of its output; an embedding
        model gives the cosine of the two embeddings. on_output(output, pair index) as each
        pair is ready."""
        params = pooling_params or PoolingParams()
        self._require_task("score", ("score",))
        firsts, seconds = score_pairs(data_1, data_2)
        score_head = self.engine.model.score
        if score_head is None:
            return self._score_by_cosine(
                firsts, seconds, params, use_tqdm, on_output, on_step, lora_request
            )
        labels = num_labels(score_head)
        if labels != 1:
            raise ValueError(
                f"score needs a cross-encoder (one label); this classifier has {labels}: "
                "use classify"
            )
        hf = self.tokenizer.hf
        pairs = [hf(a, b)["input_ids"] for a, b in zip(firsts, seconds, strict=True)]
        activate = params.use_activation is not False

        def output(v: torch.Tensor) -> Output:
            return ScoringOutput(float(torch.sigmoid(v[0]) if activate else v[0]))

        return self._pool_prompts(pairs, params, use_tqdm, output, on_output, on_step, lora_request)

    def _score_by_cosine(
        self,
        firsts: list[str],
        seconds: list[str],
        params: PoolingParams,
        use_tqdm: bool,
        on_output: Callable[[PoolingRequestOutput, int], None] | None,
        on_step: Callable[[RunStats], None] | None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """score with an embedding model: each distinct text embedded once (unit length), and
        a pair's output made as soon as both its texts are."""
        unit = PoolingParams(normalize=True, dimensions=params.dimensions)
        texts = list(dict.fromkeys([*firsts, *seconds]))
        position = {t: i for i, t in enumerate(texts)}
        ends = [(position[a], position[b]) for a, b in zip(firsts, seconds, strict=True)]
        pairs_of: dict[int, list[int]] = {}
        for pair, (a, b) in enumerate(ends):
            pairs_of.setdefault(a, []).append(pair)
            pairs_of.setdefault(b, []).append(pair)
        embedded: dict[int, PoolingRequestOutput] = {}
        outs: list[PoolingRequestOutput | None] = [None] * len(ends)

        def text_done(out: PoolingRequestOutput, text: int) -> None:
            embedded[text] = out
            for pair in pairs_of[text]:
                a, b = ends[pair]
                if outs[pair] is None and a in embedded and b in embedded:
                    outs[pair] = _cosine_output(pair, embedded[a], embedded[b])
                    if on_output is not None:
                        on_output(outs[pair], pair)

        self._pool_prompts(
            texts, unit, use_tqdm, lambda v: _embedding(v, unit), text_done, on_step, lora_request
        )
        assert all(out is not None for out in outs)
        return outs  # type: ignore[return-value]

    def _require_task(self, method: str, tasks: tuple[str, ...]) -> None:
        task = self.engine.task
        if task not in tasks:
            raise ValueError(
                f"LLM.{method} needs a model loaded with task={' or '.join(tasks)}; this one "
                f"runs task={task}: pass LLM(..., task={tasks[0]!r})"
            )

    def _pool_prompts(
        self,
        prompts: Any,
        params: PoolingParams,
        use_tqdm: bool,
        output: Callable[[torch.Tensor], Output],
        on_output: Callable[[PoolingRequestOutput, int], None] | None = None,
        on_step: Callable[[RunStats], None] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """`lora_request`: one LoRARequest for every prompt, or one (or None) per prompt."""
        bad_dims = params.check_dimensions(self.model_config.head, self.model_config.hidden_size)
        if bad_dims is not None:
            raise ValueError(bad_dims)
        requests = []
        items = as_prompt_list(prompts)
        loras = self._per_prompt_lora(lora_request, len(items))
        for i, (prompt, lora) in enumerate(zip(items, loras, strict=True)):
            req = self._make_request(i, prompt, _PROMPT_ONLY, lora)
            req.pooling = self.engine.pooling
            requests.append(req)

        def make(req: Request, seqs: list[Sequence]) -> PoolingRequestOutput:
            out = PoolingRequestOutput(str(req.index), req.prompt_token_ids, None, error=req.error)
            if seqs:
                pooled = seqs[0].result.pooled
                assert pooled is not None
                out.outputs = output(pooled)
                out.num_cached_tokens = seqs[0].num_cached_tokens
            return out

        return self._run(requests, use_tqdm, on_output, on_step, make_output=make)


def score_pairs(data_1: str | Seq[str], data_2: str | Seq[str]) -> tuple[list[str], list[str]]:
    """score's pairs: one data_1 against every data_2, or data_1[i] with data_2[i]."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"score takes one data_1 or as many as data_2; got {len(firsts)} and {len(seconds)}"
        )
    return firsts, seconds


def _embedding(vector: torch.Tensor, params: PoolingParams) -> EmbeddingOutput:
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize is not False:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return EmbeddingOutput(vector.tolist())


def _cosine_output(
    pair: int, a: PoolingRequestOutput, b: PoolingRequestOutput
) -> PoolingRequestOutput:
    """The dot product of two unit embeddings; the first error of the two, if any."""
    error = a.error or b.error
    out = None
    if error is None:
        assert isinstance(a.outputs, EmbeddingOutput) and isinstance(b.outputs, EmbeddingOutput)
        dot = torch.dot(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding))
        out = ScoringOutput(float(dot))
    ids = a.prompt_token_ids + b.prompt_token_ids
    return PoolingRequestOutput(str(pair), ids, out, error=error)


def _activation(values: torch.Tensor) -> torch.Tensor:
    """Softmax over the labels; a sigmoid for one label (as vLLM's classifier does)."""
    return torch.sigmoid(values) if values.numel() == 1 else torch.softmax(values, dim=-1)
