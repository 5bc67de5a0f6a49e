"""Load a Hugging Face checkpoint folder (config.json + safetensors) into its family's model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.families import build_model
from batchpage.model.hf_config import model_config_from_hf

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: pass a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}): restore the model's config.json"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object: restore the model's config.json")
    try:
        return model_config_from_hf(raw)
    except ValueError as e:  # one line that says which checkpoint, keeping the error's type
        raise type(e)(f"{folder}: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: those the index names, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
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
) -> tuple[CausalLM, ModelConfig]:
    cfg = read_hf_config(folder)
    model = build_model(cfg, dtype, device, max_positions)
    model.load_weights(iter_safetensors(safetensors_files(folder)))
    return model.eval(), cfg
