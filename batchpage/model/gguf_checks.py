"""Checks of a GGUF header's numbers before anything is sized from them.

gguf_file.py checks the file's structure; these check what the metadata says: each size is an
integer in range, each float finite, and the model the sizes describe has no more parameters
than the file holds weights (so a hostile 4e9 vocabulary is refused before a 65 TB allocation).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from batchpage.model.config import ModelConfig
from batchpage.model.gguf_file import CorruptGGUFError, GGUFHeader

# `<arch>.<key>` integers; expert counts may be 0 (a dense model).
_SIZE_KEYS = (
    "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "rope.dimension_count", "vocab_size", "attention.sliding_window",
)  # fmt: skip
_COUNT_KEYS = ("expert_count", "expert_used_count")
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
_TOKEN_KEYS = tuple(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "padding"))
MAX_SIZE = 2**31 - 1  # llama.cpp keeps sizes in int32
MAX_CONTEXT = 2**24  # positions: above any supported model; the RoPE tables grow with it


def check_metadata(path: Path, header: GGUFHeader) -> None:
    """Raises CorruptGGUFError naming the first key whose value cannot be a model's."""
    meta = header.meta
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise _bad(path, "general.architecture", arch, "the architecture's name")
    for name in _SIZE_KEYS:
        _check_int(path, meta, f"{arch}.{name}", 1, MAX_SIZE)
    for name in _COUNT_KEYS:
        _check_int(path, meta, f"{arch}.{name}", 0, MAX_SIZE)
    _check_int(path, meta, f"{arch}.context_length", 1, MAX_CONTEXT)
    for key in _TOKEN_KEYS:
        _check_int(path, meta, key, 0, MAX_SIZE)
    # tokenizer.ggml.tokens is an array, held as its length; a vocabulary of none is no model.
    _check_int(path, meta, "tokenizer.ggml.tokens", 1, MAX_SIZE)
    for name in _FLOAT_KEYS:
        value = meta.get(f"{arch}.{name}")
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (math.isfinite(value) and value > 0)
        ):
            raise _bad(path, f"{arch}.{name}", value, "a finite positive number")

    # Every layer has tensors of its own: a block_count beyond the number of tensors is refused
    # here, cheaply (building even a meta-device model takes time linear in its layers).
    layers = meta.get(f"{arch}.block_count")
    if isinstance(layers, int) and layers > len(header.tensors):
        raise CorruptGGUFError(
            f"{path}: the GGUF metadata says {layers} layers ({arch}.block_count) but the file "
            f"holds only {len(header.tensors)} tensors: download or convert the file again"
        )


def check_declared_size(path: Path, header: GGUFHeader, cfg: ModelConfig) -> None:
    """The model the metadata describes, built on the meta device (no memory), must not have
    more parameters than the file holds weights: each parameter is loaded from one."""
    from batchpage.model.families import build_model  # the model classes import this package

    declared = sum(p.numel() for p in build_model(cfg, torch.float32, "meta", 1).parameters())
    stored = sum(math.prod(t.shape) for t in header.tensors)
    if declared > stored:
        raise CorruptGGUFError(
            f"{path}: the GGUF metadata describes a model of {declared:,} parameters but the "
            f"file holds {stored:,} weights (vocab_size={cfg.vocab_size}, "
            f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
            f"num_layers={cfg.num_layers}): a size key is wrong; download or convert the file "
            "again"
        )


def _check_int(path: Path, meta: dict[str, Any], key: str, low: int, high: int) -> None:
    value = meta.get(key)
    if value is not None and (type(value) is not int or not low <= value <= high):
        raise _bad(path, key, value, f"an integer from {low} to {high:,}")


def _bad(path: Path, key: str, value: Any, wanted: str) -> CorruptGGUFError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    return CorruptGGUFError(
        f"{path}: GGUF key {key} is {shown} ({type(value).__name__}), not {wanted}: the file is "
        "damaged; download or convert it again"
    )
