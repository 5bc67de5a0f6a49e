"""adapter_config.json's module selection and ranks read as PEFT reads them: for adapters PEFT
writes with every way of choosing modules, the modules and ranks of PeftTargets (and of the
adapter read_adapter returns) are those of the LoRA modules PEFT itself built."""

from __future__ import annotations

import json

import pytest
import torch

from batchpage.lora.adapter import read_adapter
from batchpage.lora.peft_config import PeftTargets
from batchpage.lora.request import LoRARequest
from tests.lora.peft_adapters import ALL_TARGETS, make_adapter
from tests.lora.test_adapter import targets_of
from tests.model_factory import build_hf_model


@pytest.fixture(scope="module")
def base():
    return build_hf_model("llama_gqa_tied", vocab_size=96)


def projections(model) -> list[str]:
    """The names of the base's linears adapters may target, as PEFT sees them."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and (".self_attn." in name or ".mlp." in name)
    ]


@pytest.mark.parametrize(
    "config",
    [
        dict(targets=["q_proj", "down_proj"], rank_pattern={"down_proj": 2}),
        dict(targets=r".*\.self_attn\.(q|v)_proj"),
        dict(targets=["q_proj", "k_proj", "mlp.up_proj"], layers_to_transform=[1]),
        dict(targets=["q_proj", "v_proj"], layers_to_transform=0, layers_pattern="layers"),
        dict(targets=ALL_TARGETS, exclude_modules=["o_proj"]),
        dict(targets=ALL_TARGETS, exclude_modules=r".*\.1\.mlp\..*"),
        dict(rank_pattern={r"layers\.1\.self_attn\.q_proj": 2, "q_proj": 3, "mlp.up_proj": 1}),
    ],
)
def test_selection_and_ranks_are_pefts(tmp_path, base, config):
    peft = make_adapter(base, tmp_path, rank=4, **config)
    built = {
        name.removeprefix("base_model.model."): module.r["default"]
        for name, module in peft.named_modules()
        if hasattr(module, "lora_A") and "default" in module.lora_A
    }
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    read = PeftTargets.of(saved, ValueError)
    ours = {m: read.rank_of(m) for m in projections(base) if read.selects(m)}
    assert ours == built
    # Nothing PEFT wrote is refused, and what is read is what PEFT built.
    adapter = read_adapter(LoRARequest("a", 1, str(tmp_path)), targets_of(base), max_rank=8)
    assert {
        f"model.layers.{i}.{name}": a.shape[0] for (i, name), (a, _) in adapter.weights.items()
    } == built


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(r=0), "r must be a positive integer"),
        (dict(rank_pattern={"q_proj": "4"}), "rank_pattern"),
        (dict(target_modules="(q_proj"), "not a regular expression"),
        (dict(target_modules=[1]), "target_modules must be"),
        (dict(layers_to_transform="0"), "layers_to_transform"),
    ],
)
def test_fields_of_the_wrong_type_are_the_adapters_error(changes, match):
    with pytest.raises(ValueError, match=match):
        PeftTargets.of({"r": 4, "target_modules": ["q_proj"], **changes}, ValueError)
