"""A pooling job's output (engine.task embed, classify, reward or score): its columns, each
row's values, and the LLM method that makes them, with the job's PoolingParams (pooling.*).

embed: `embedding`, the pooled hidden state (a fixed-size list of float32: pooling.dimensions
long for a Matryoshka model, else the hidden size; normalized unless pooling.normalize=false),
and for an OpenAI Batch file a list of them, one per input of the line, and its /v1/embeddings
answers;
classify: `label` (id2label's name of the likeliest label, else its id) and `probs`;
reward: `score`, the reward head's first output;
score: `score`, the relevance of the row's prompt (data_1) and its dataset.response_column
(data_2), as LLM.score gives it. The completion columns stay empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa

from batchpage.data.openai_batch import EMBEDDINGS_URL
from batchpage.data.rows import Row
from batchpage.job.prompts import Prepared
from batchpage.model.config import ModelConfig
from batchpage.output.files import ResultRow
from batchpage.pooling_params import PoolingParams
from batchpage.request_outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)

POOLING_JOB_TASKS = ("embed", "classify", "reward", "score")
OnRow = Callable[[Prepared, list[PoolingRequestOutput]], None]


BLANK_RESPONSE = "response is empty: a score job needs a second text to score the prompt against"


def pool_schema(
    task: str, model: ModelConfig, params: PoolingParams, listed: bool = False
) -> pa.Schema:
    """The derived columns of a pooling job's output; `listed`: a list of embeddings a row."""
    if task == "embed":
        one = pa.list_(pa.float32(), params.dimensions or model.hidden_size)
        return pa.schema([("embedding", pa.list_(one) if listed else one)])
    if task == "classify":
        return pa.schema([("label", pa.string()), ("probs", pa.list_(pa.float32()))])
    return pa.schema([("score", pa.float64())])


def check_url(row: Row, task: str) -> Row:
    """An OpenAI Batch line whose url the job's task does not serve gets that as its error:
    /v1/embeddings needs an embedding job, the others a generation job."""
    url = row.extra.get("url")
    if row.error is None and url is not None and (url == EMBEDDINGS_URL) != (task == "embed"):
        needs = (
            "engine.task=embed (an embedding model)"
            if url == EMBEDDINGS_URL
            else ("a generation model")
        )
        row.error = (
            f"{url} needs a job with {needs}; this one runs engine.task={task}: put these "
            "lines in a file of their own"
        )
    return row


def pool_rows(
    llm: Any,
    task: str,
    ready: list[Prepared],
    params: PoolingParams,
    on_row: OnRow,
    on_step: Callable[..., None],
) -> None:
    """The window's rows through the task's LLM method; on_row(prepared, its outputs: one per
    input, in order) as the last of a row's inputs is done."""
    if task == "score":
        # A blank response scores nothing (a cross-encoder would score the prompt alone).
        blank = [p for p in ready if not (p.row.response or "").strip()]
        for p in blank:
            on_row(p, [PoolingRequestOutput(str(p.row.index), [], None, error=BLANK_RESPONSE)])
        ready = [p for p in ready if (p.row.response or "").strip()]
        firsts = [p.row.prompt or "" for p in ready]
        seconds = [p.row.response or "" for p in ready]

        def pair_done(out: PoolingRequestOutput, i: int) -> None:
            on_row(ready[i], [out])

        if ready:
            llm.score(firsts, seconds, params, use_tqdm=False, on_output=pair_done, on_step=on_step)
        return
    owner = [(i, j) for i, p in enumerate(ready) for j in range(len(p.prompts))]
    got: dict[int, dict[int, PoolingRequestOutput]] = {}

    def input_done(out: PoolingRequestOutput, k: int) -> None:
        i, j = owner[k]
        outs = got.setdefault(i, {})
        outs[j] = out
        if len(outs) == len(ready[i].prompts):
            on_row(ready[i], [outs[n] for n in range(len(outs))])
            del got[i]

    method = {"embed": llm.embed, "classify": llm.classify, "reward": llm.reward}[task]
    prompts = [ids for p in ready for ids in p.prompts]
    method(prompts, params, use_tqdm=False, on_output=input_done, on_step=on_step)


def pool_result(
    p: Prepared,
    outs: list[PoolingRequestOutput],
    task: str,
    labels: tuple[str, ...],
    listed: bool = False,
) -> ResultRow:
    """The output row of a pooled row (outs: one per input); `listed`: the embedding column
    holds a list of embeddings (an OpenAI Batch embeddings job)."""
    errors = [(j, o.error) for j, o in enumerate(outs) if o.error is not None]
    error = None
    if errors:
        j, error = errors[0]
        error = f"input[{j}]: {error}" if len(outs) > 1 else error
    row = ResultRow(
        p.row.index,
        p.row.id,
        p.text,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        completion_tokens=0,
        cached_tokens=sum(o.num_cached_tokens for o in outs),
        error=error,
        extra=dict(p.row.extra),
    )
    if error is not None:
        return row
    if task == "embed":
        embeddings = []
        for o in outs:
            assert isinstance(o.outputs, EmbeddingOutput)
            embeddings.append(o.outputs.embedding)
        row.extra["embedding"] = embeddings if listed else embeddings[0]
        return row
    result = outs[0].outputs
    if task == "classify":
        assert isinstance(result, ClassificationOutput)
        best = max(range(len(result.probs)), key=result.probs.__getitem__)
        row.extra["label"] = labels[best] if labels else str(best)
        row.extra["probs"] = result.probs
    elif task == "score":
        assert isinstance(result, ScoringOutput)
        row.extra["score"] = result.score
    else:
        row.extra["score"] = float(result.data[0])  # type: ignore[union-attr]
    return row
