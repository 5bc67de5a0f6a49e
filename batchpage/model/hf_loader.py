"""Load a Hugging Face checkpoint folder (config.json + safetensors) into its family's model.

Every failure of a damaged or hostile folder is a ValueError of one line naming the file and the
fix (the job's exit 2): the checks before any allocation are in hf_checks.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.families import build_model
from batchpage.model.hf_checks import read_index, read_shapes
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.quant_layout import check_quantized, load_quantized
from batchpage.model.shard import TensorShard

INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 16 << 20  # a real config.json is a few KiB; this bounds reading a hostile one


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: pass a Hugging Face model folder")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{path} has {path.stat().st_size:,} bytes, more than any model's config.json "
            f"({MAX_CONFIG_BYTES:,} at most): restore the model's config.json"
        )
    try:
        raw = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise ValueError(
            f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:200]}): restore the "
            "model's config.json"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object: restore the model's config.json")
    try:
        return model_config_from_hf(raw)
    except ValueError as e:  # one line that says which checkpoint, keeping the error's type
        raise type(e)(f"{folder}: {e}") from None
    except (TypeError, AttributeError, KeyError, ArithmeticError, RecursionError) as e:
        # A value of the wrong kind where the readers expect a number, a list or an object.
        raise ValueError(
            f"{path} holds a value of the wrong type or range ({type(e).__name__}: "
            f"{str(e)[:200]}): restore the model's config.json"
        ) from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: those the index names, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = [folder / name for name in read_index(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: {INDEX_FILE} names missing files {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = (
            " (found PyTorch .bin weights: re-save them with "
            "model.save_pretrained(folder, safe_serialization=True))"
            if any(folder.glob("*.bin"))
            else ""
        )
        raise ValueError(f"{folder} has no *.safetensors weights{hint}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, one file open at a time; tensors are mmapped on the CPU."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_hf_model(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    shard: TensorShard | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The model (with `shard`, one tensor-parallel rank's share) and the checkpoint's whole
    config. A quantized linear's tensors are decoded to IntWeight's row-major layout first
    (decode_stream), so a rank's share is cut as a dense weight's is: output rows, or whole
    groups of inputs (plan.check_tensor_parallel refuses shapes that do not split so)."""
    cfg = read_hf_config(folder)
    model = build_model(cfg, dtype, device, max_positions, shard)
    try:
        files = safetensors_files(folder)
        weights = iter_safetensors(files)
        if cfg.quant is not None:
            weights = load_quantized(model, cfg.quant, read_shapes(files), weights)
        model.load_weights(weights)
        check_quantized(model)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    except (SafetensorError, OSError) as e:  # a file changed or damaged since it was checked
        raise ValueError(
            f"{folder}: reading the weights failed ({e}): download the model again"
        ) from None
    return model.eval(), cfg
