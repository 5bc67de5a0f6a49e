"""config.json's `architectures` -> the head a checkpoint carries (model/config.py HeadConfig).

A pooling checkpoint is one of the supported families with a different head: the decoder stack
and final norm load as for the causal LM, and only the head differs. Bounded: a label table
holds at most MAX_LABELS labels (config.json's own size is bounded where it is read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpage.model.config import HeadConfig, UnsupportedModelError

MAX_LABELS = 65_536
# Architecture suffixes that are causal LMs (the vocabulary's logits).
_CAUSAL = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def read_head(cfg: Mapping[str, Any]) -> HeadConfig:
    """The head of the checkpoint whose config.json is `cfg`; raises ValueError for a malformed
    label table, UnsupportedModelError for an architecture whose head batchpage does not run."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    matryoshka = bool(cfg.get("is_matryoshka")) or bool(cfg.get("matryoshka_dimensions"))
    dims = tuple(int(d) for d in cfg.get("matryoshka_dimensions") or ())
    if not arch or arch.endswith(_CAUSAL):
        return HeadConfig("lm", matryoshka=matryoshka, matryoshka_dimensions=dims)
    labels = _labels(cfg)
    if arch.endswith("ForSequenceClassification"):
        kind, default = "linear", 2  # transformers' default num_labels
    elif arch.endswith("ForRewardModel"):
        kind, default = "mlp", 1
    elif arch.endswith("Model"):
        return HeadConfig("none", matryoshka=matryoshka, matryoshka_dimensions=dims)
    else:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}: batchpage runs *ForCausalLM (generation), "
            "*ForSequenceClassification and *ForRewardModel (classify, score, reward) and *Model "
            "(embed) checkpoints of its families"
        )
    # transformers' rule: an explicit num_labels wins over id2label (whose default has two).
    num = int(cfg["num_labels"]) if "num_labels" in cfg else len(labels) or default
    if not 0 < num <= MAX_LABELS:
        raise ValueError(f"config.json: {num} labels: a classifier has 1 to {MAX_LABELS:,}")
    return HeadConfig(kind, num, labels if len(labels) == num else (), matryoshka, dims)


def _labels(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """id2label's labels in id order (ids 0..n-1), or () when it has none."""
    table = cfg.get("id2label") or {}
    if not isinstance(table, dict):
        raise ValueError("config.json: id2label must map ids to labels: restore the config.json")
    if len(table) > MAX_LABELS:
        raise ValueError(f"config.json: id2label has {len(table):,} labels, over {MAX_LABELS:,}")
    try:
        by_id = {int(k): str(v) for k, v in table.items()}
    except ValueError:
        raise ValueError("config.json: id2label's keys must be integer ids") from None
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("config.json: id2label's ids must be 0 to n - 1: restore the config.json")
    return tuple(by_id[i] for i in range(len(by_id)))
