"""LoRA adapters made by the peft library itself, on copies of a tiny HF model, with every A and
B drawn at random (PEFT initialises B to zero, which would hide any mistake)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: PreTrainedModel,
    folder: Path,
    rank: int = 4,
    alpha: float = 16,
    targets: list[str] | None = None,
    seed: int = 0,
    scale: float = 0.1,
    **config: Any,
) -> PeftModel:
    """PEFT's LoRA over a copy of `base`, saved to `folder`; returns the (unmerged) model."""
    model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, **config),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(folder)
    return model.eval()


def merged(model: PeftModel) -> PreTrainedModel:
    """The adapter merged into a copy of its base (PEFT's merge_and_unload)."""
    return copy.deepcopy(model).merge_and_unload().eval()


def edit_config(folder: Path, **changes: Any) -> Path:
    """`folder`'s adapter_config.json with `changes` written over its fields."""
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def poison(folder: Path, value: float) -> Path:
    """`folder`'s adapter with one entry of its last tensor (by name) set to `value`."""
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors[max(tensors)].view(-1)[-1] = value
    save_file(tensors, path, metadata={"format": "pt"})
    return folder
