"""A pooling checkpoint's score head (model/config.py HeadConfig), named as in its files.

It runs on pooled rows only (one per request), so it stays a plain torch module: the engine's
linear methods are for the per-token linears.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from batchpage.model.config import ModelConfig


def make_score_head(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> nn.Module | None:
    """`linear`: score.weight [labels, hidden], no bias (*ForSequenceClassification); `mlp`:
    score.0 [hidden, hidden] and score.2 [labels, hidden], both with biases, ReLU between
    (*ForRewardModel). None for the other heads. Parameters uninitialized until loaded."""
    head, hidden = cfg.head, cfg.hidden_size
    if head.kind == "linear":
        return skip_init(nn.Linear, hidden, head.num_labels, bias=False, dtype=dtype, device=device)
    if head.kind == "mlp":
        return nn.Sequential(
            skip_init(nn.Linear, hidden, hidden, dtype=dtype, device=device),
            nn.ReLU(),
            skip_init(nn.Linear, hidden, head.num_labels, dtype=dtype, device=device),
        )
    return None


def token_classifier(rows: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """A classifier from an lm_head's rows for its tokens (float32 [T, hidden]): for two tokens
    one label whose weight is rows[1] - rows[0] (its logit: the difference of the two tokens'
    logits, so its sigmoid is the second's softmax probability over the pair); else one label a
    token. Its weight in `dtype`, on the rows' device."""
    weight = (rows[1] - rows[0])[None] if len(rows) == 2 else rows
    head = nn.Linear(rows.shape[1], weight.shape[0], bias=False, dtype=dtype, device=rows.device)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head.requires_grad_(False)


def num_labels(head: nn.Module) -> int:
    """How many outputs a score head has (its last linear's)."""
    last = head[-1] if isinstance(head, nn.Sequential) else head
    assert isinstance(last, nn.Linear)
    return last.out_features
