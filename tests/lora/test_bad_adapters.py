"""Adapter folders that must not run as they are, refused by read_adapter with the adapter's
name, with or without a base model to fit: NaN or infinite weights (which PEFT runs, to
non-finite logits), and an adapter_config.json that contradicts its tensors (which PEFT refuses,
or loads leaving tensors out)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from batchpage.lora.adapter import AdapterError, read_adapter
from batchpage.lora.request import LoRARequest
from tests.lora.peft_adapters import edit_config, make_adapter, poison
from tests.lora.test_adapter import targets_of
from tests.model_factory import build_hf_model


@pytest.fixture(scope="module")
def base():
    return build_hf_model("llama_gqa_tied", vocab_size=96)


def refused(folder: Path, base, match: str) -> None:
    """read_adapter refuses `folder` naming it, fitted to `base` and before any base model."""
    request = LoRARequest("bad", 1, str(folder))
    for targets in (targets_of(base), None):
        with pytest.raises(AdapterError, match=rf"adapter 'bad' \({folder}\): .*{match}"):
            read_adapter(request, targets, max_rank=16)


def peft_loaded(base, folder: Path) -> PeftModel:
    return PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()


@pytest.mark.parametrize(("value", "kind"), [(math.nan, "NaN"), (math.inf, "infinite")])
def test_nan_or_infinite_weights_are_refused(tmp_path, base, value, kind):
    make_adapter(base, tmp_path)
    poison(tmp_path, value)
    with torch.no_grad():  # PEFT runs it: every logit of the last position is garbage
        logits = peft_loaded(base, tmp_path)(torch.tensor([[5, 9, 13, 17]])).logits
    assert not torch.isfinite(logits[0, -1]).any()
    refused(tmp_path, base, f"holds {kind} values")


@pytest.mark.parametrize(
    ("changes", "want"),
    [(dict(r=8), 8), (dict(rank_pattern={"down_proj": 2}), 2), (dict(r=None), 8)],
)
def test_a_rank_other_than_the_configs_is_refused_as_peft_refuses(tmp_path, base, changes, want):
    make_adapter(base, tmp_path, rank=4)
    path = tmp_path / "adapter_config.json"
    config = {**json.loads(path.read_text()), **changes}
    if config["r"] is None:
        del config["r"]  # LoraConfig's default r then
    path.write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft_loaded(base, tmp_path)
    refused(tmp_path, base, f"rank 4, but adapter_config.json gives its module rank {want}")


@pytest.mark.parametrize("targets", [["nonexistent_proj"], r".*\.attention\.qkv"])
def test_target_modules_the_base_lacks_are_refused_as_peft_refuses(tmp_path, base, targets):
    make_adapter(base, tmp_path)
    edit_config(tmp_path, target_modules=targets)
    with pytest.raises(ValueError, match="not found in the base model"):
        peft_loaded(base, tmp_path)
    refused(tmp_path, base, "select none of the modules its tensors adapt")


@pytest.mark.parametrize(
    "changes",
    [
        dict(target_modules=["q_proj"]),
        dict(layers_to_transform=[0]),
        dict(exclude_modules=["k_proj"]),
    ],
)
def test_tensors_the_config_does_not_select_are_refused(tmp_path, base, changes):
    make_adapter(base, tmp_path)
    edit_config(tmp_path, **changes)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        in_file = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in f.keys()}  # noqa: SIM118
    loaded = {
        name.removeprefix("base_model.model.")
        for name, module in peft_loaded(base, tmp_path).named_modules()
        if hasattr(module, "lora_A") and "default" in module.lora_A
    }
    assert loaded and in_file - loaded  # PEFT loads it, leaving some of its tensors out
    refused(tmp_path, base, "which adapter_config.json's target_modules")


def test_lora_alpha_must_be_finite(tmp_path, base):
    make_adapter(base, tmp_path)
    config = tmp_path / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": Infinity'))
    refused(tmp_path, base, "lora_alpha must be a positive number, got inf")
