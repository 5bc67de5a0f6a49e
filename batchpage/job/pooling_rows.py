"""A pooling job's output (engine.task embed, classify, reward or score): its columns, each
row's values, and the LLM method that makes them, with the job's PoolingParams (pooling.*).

embed: `embedding`, the pooled hidden state (a fixed-size list of float32: pooling.dimensions
long for a Matryoshka model, else the hidden size; normalized unless pooling.normalize=false),
and for an OpenAI Batch file its /v1/embeddings answers;
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
from batchpage.outputs import (
    ClassificationOutput,
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from batchpage.pooling_params import PoolingParams

POOLING_JOB_TASKS = ("embed", "classify", "reward", "score")
OnOutput = Callable[[PoolingRequestOutput, int], None]


def pool_schema(task: str, model: ModelConfig, params: PoolingParams) -> pa.Schema:
    """The derived columns of a pooling job's output."""
    if task == "embed":
        size = params.dimensions or model.hidden_size
        return pa.schema([("embedding", pa.list_(pa.float32(), size))])
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
    on_output: OnOutput,
    on_step: Callable[..., None],
) -> None:
    """The window's rows through the task's LLM method; on_output(output, index in ready)."""
    if task == "score":
        firsts = [p.row.prompt or "" for p in ready]
        seconds = [p.row.response or "" for p in ready]
        llm.score(firsts, seconds, params, use_tqdm=False, on_output=on_output, on_step=on_step)
        return
    method = {"embed": llm.embed, "classify": llm.classify, "reward": llm.reward}[task]
    prompts = [p.prompt_ids for p in ready]
    method(prompts, params, use_tqdm=False, on_output=on_output, on_step=on_step)


def pool_result(
    p: Prepared, out: PoolingRequestOutput, task: str, labels: tuple[str, ...]
) -> ResultRow:
    row = ResultRow(
        p.row.index,
        p.row.id,
        p.text,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=0,
        cached_tokens=out.num_cached_tokens,
        error=out.error,
        extra=dict(p.row.extra),
    )
    if out.error is not None:
        return row
    result = out.outputs
    if task == "embed":
        assert isinstance(result, EmbeddingOutput)
        row.extra["embedding"] = result.embedding
    elif task == "classify":
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
