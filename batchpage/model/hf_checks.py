"""Checks of a Hugging Face folder's weight files against its config.json, before anything is
sized from either.

Each safetensors header is bounded by the file it sits in (its length field, then the
safetensors library's own checks: every tensor's offsets inside the file, shapes that match
their bytes, the file wholly covered), and the model config.json describes is built on the meta
device (no memory) and loaded from meta tensors of the headers' shapes: the same name and shape
checks a real load makes, so a hostile `vocab_size` or `hidden_size` is refused here, before a
terabyte allocation, and a damaged file before a traceback.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from batchpage.model.config import ModelConfig, UnsupportedModelError

# safetensors refuses larger headers itself (its MAX_HEADER_SIZE); checked here first so that
# the message names the file and the numbers.
MAX_HEADER_BYTES = 100 << 20
REDOWNLOAD = "download the model again (or re-save it with save_pretrained)"

Shapes = dict[str, tuple[int, ...]]


def read_shapes(files: list[Path]) -> Shapes:
    """Every tensor's shape, by name, from the files' headers (no tensor data is read). Raises
    ValueError naming the file when one is not a whole, valid safetensors file."""
    shapes: Shapes = {}
    for path in files:
        _check_header_length(path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(
                f"{path} is not a valid safetensors file ({e}): {REDOWNLOAD}"
            ) from None
    return shapes


def _check_header_length(path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path} has {size} bytes, too few for a safetensors file: {REDOWNLOAD}")
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(
            f"{path}: its safetensors header claims {length:,} bytes, but the file holds "
            f"{size:,} (and a header may have at most {MAX_HEADER_BYTES:,}): the file is "
            f"truncated or damaged; {REDOWNLOAD}"
        )


def check_weights(folder: Path, cfg: ModelConfig, shapes: Shapes) -> int:
    """The model `cfg` describes must load from exactly these tensors (every parameter from one
    of its shape, no tensor unknown to the architecture). Returns its parameter count. Raises
    ValueError naming the folder, the tensor and the sizes."""
    from batchpage.model.families import build_model  # the model classes import this package
    from batchpage.model.quant_layout import load_quantized

    # Every layer has tensors of its own: a layer count beyond the number of tensors is refused
    # before the meta model is built (that takes time linear in the layers).
    if cfg.num_layers > len(shapes):
        raise ValueError(
            f"{folder}: config.json says {cfg.num_layers} layers (num_hidden_layers) but the "
            f"weights hold only {len(shapes)} tensors: use the config.json that came with them"
        )
    if cfg.vision is not None and cfg.vision.num_layers > len(shapes):  # the same for a tower
        raise ValueError(
            f"{folder}: config.json says {cfg.vision.num_layers} vision tower layers "
            f"(vision_config num_hidden_layers) but the weights hold only {len(shapes)} "
            "tensors: use the config.json that came with them"
        )
    try:
        model = build_model(cfg, torch.float32, "meta", 1)
        tensors = _meta_tensors(shapes)
        if cfg.quant is not None:
            tensors = load_quantized(model, cfg.quant, shapes, tensors)
        model.load_weights(tensors)
    except UnsupportedModelError as e:  # what batchpage does not run: not a mismatch
        raise UnsupportedModelError(f"{folder}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{folder}: {e} ({_sizes(cfg)}): {_mismatch_fix()}") from None
    except (RuntimeError, TypeError, IndexError) as e:  # a shape the layers cannot even form
        raise ValueError(
            f"{folder}: config.json describes a model that cannot be built ({e}; "
            f"{_sizes(cfg)}): {_mismatch_fix()}"
        ) from None
    return sum(p.numel() for p in model.parameters())


def _meta_tensors(shapes: Shapes) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shapes.items():
        if math.prod(shape) > 2**62:  # torch's own limit on a tensor's element count
            raise ValueError(f"weight {name!r} claims the impossible shape {shape}")
        yield name, torch.empty(shape, device="meta")


def _sizes(cfg: ModelConfig) -> str:
    return (
        f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
        f"intermediate_size={cfg.intermediate_size}, num_layers={cfg.num_layers}"
    )


def _mismatch_fix() -> str:
    return "config.json and the weights disagree; use the config.json that came with the weights"


def read_index(index: Path) -> list[str]:
    """The weight files an index names (model.safetensors.index.json's weight_map), each a
    plain file name in the index's folder. ValueError naming the fix otherwise."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ValueError(
            f"{index} is not a safetensors index (a JSON object with a weight_map of tensor "
            f"names to file names: {type(e).__name__} {e}): {REDOWNLOAD}"
        ) from None
    bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
    if bad:
        raise ValueError(
            f"{index} names weight files outside its folder or not file names: {bad[:3]}: "
            f"{REDOWNLOAD}"
        )
    return names
