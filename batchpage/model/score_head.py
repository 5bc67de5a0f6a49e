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
