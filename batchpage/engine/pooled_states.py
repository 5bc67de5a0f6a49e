"""Pooling models: a prompt's hidden states -> one vector, with no decode.

A pooling request runs like a generation request up to its prompt's end, through the same
paged pool, radix cache and chunked prefill, and then finishes instead of sampling. What it
reads of the final norm's output depends on the pooling type:

    LAST  the last prompt position's row: the row a generation request would sample from.
          Shares cached prefixes like generation (a cached block's positions are not needed).
    MEAN  the mean over every prompt position: each chunk's rows are summed as they are
          computed, so such a request borrows no cached prefix (those rows were never made).
    CLS   the first position's row; no cached prefix either.

The model's head (`CausalLM.pool_head`: a classifier's score, or none for an embedder) then
runs on the pooled vectors of the requests that finished in the step, in one call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from batchpage.model.config import HeadConfig

# LLM(task=...): what the engine runs the model for. generate: completions; embed: pooled
# hidden states; classify: a classifier's label probabilities; reward: its raw outputs; score:
# a pair's relevance (a cross-encoder's, or two embeddings' cosine).
TASKS = ("auto", "generate", "embed", "classify", "score", "reward")
_AUTO = {"lm": "generate", "none": "embed", "linear": "classify", "mlp": "reward"}


class PoolingType(enum.Enum):
    LAST = "last"
    MEAN = "mean"
    CLS = "cls"

    @property
    def reads_every_row(self) -> bool:
        """Whether it reads positions before the last (so no cached prefix may stand in)."""
        return self is not PoolingType.LAST

    def chunk_rows(self, start: int, end: int) -> range:
        """The positions of a prompt chunk [start, end) whose rows this pooling sums."""
        if self is PoolingType.MEAN:
            return range(start, end)
        if self is PoolingType.CLS:
            return range(0, 1) if start == 0 else range(0)
        return range(0)


POOLING_TYPES = tuple(p.value for p in PoolingType)


@dataclass
class PoolSum:
    """A pooling sequence's state (attached to it while its prompt is computed): the float32
    running sum [hidden] of the rows it reads."""

    total: torch.Tensor | None = None

    def add_chunk(self, start: int, rows: torch.Tensor) -> None:
        """Add a chunk starting at position `start` (rows [n, hidden]); a chunk at position 0
        starts over (a recompute after preemption)."""
        chunk = rows.float().sum(0)
        self.total = chunk if start == 0 or self.total is None else self.total + chunk


def pooled_vector(
    pooling: PoolingType, total: torch.Tensor | None, last_row: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The prompt's pooled hidden state [hidden] once its last position is computed."""
    if pooling is PoolingType.LAST:
        return last_row
    assert total is not None, "a MEAN or CLS sequence's first chunk was not pooled"
    return total / num_tokens if pooling is PoolingType.MEAN else total


def resolve_task(task: str, head: HeadConfig, token_classifier: bool = False) -> str:
    """The task the engine runs for a checkpoint with this head ("auto": its own);
    `token_classifier`: a causal LM's head becomes a classifier over some of its tokens
    (EngineConfig.classifier_from_token). Raises ValueError for a task the head cannot serve,
    naming the checkpoint it needs."""
    if token_classifier:
        if head.kind != "lm" or task not in ("classify", "score"):
            raise ValueError(
                "classifier_from_token makes a causal LM's lm_head a classifier (a Qwen3-Reranker "
                "style yes/no model): it needs a *ForCausalLM checkpoint and task=score or "
                "task=classify"
            )
        return task
    if task == "auto":
        return _AUTO[head.kind]
    if task == "generate" and head.pools:
        raise ValueError(
            f"task=generate needs a causal LM, and this checkpoint's head is a pooling one "
            f"({head.kind}): use task={_AUTO[head.kind]} (LLM.{_AUTO[head.kind]}), or a "
            "*ForCausalLM checkpoint"
        )
    if task in ("classify", "reward") and head.kind not in ("linear", "mlp"):
        raise ValueError(
            f"task={task} needs a score head (a *ForSequenceClassification or *ForRewardModel "
            "checkpoint); this one has none: use task=embed, or such a checkpoint"
        )
    return task


def uses_score_head(task: str) -> bool:
    """Whether the task's outputs come from the score head (else: pooled hidden states)."""
    return task in ("classify", "reward", "score")
