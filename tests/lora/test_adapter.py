"""Reading PEFT adapter folders: the weights against PEFT's own modules, and every refusal."""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchpage.lora.adapter import AdapterError, TargetShapes, read_adapter
from batchpage.lora.registry import AdapterRegistry
from batchpage.lora.request import LoRARequest
from tests.lora.peft_adapters import make_adapter
from tests.model_factory import build_hf_model

VOCAB = 96


@pytest.fixture(scope="module")
def base():
    return build_hf_model("llama_gqa_tied", vocab_size=VOCAB)


def targets_of(model) -> TargetShapes:
    """The shapes of every projection PEFT may target, read from the HF model itself."""
    shapes = {}
    for i, layer in enumerate(model.model.layers):
        for part in ("self_attn", "mlp"):
            for name, module in getattr(layer, part).named_children():
                if isinstance(module, torch.nn.Linear):
                    shapes[(i, f"{part}.{name}")] = (module.in_features, module.out_features)
    return TargetShapes(shapes)


def request(path, name="a", int_id=1) -> LoRARequest:
    return LoRARequest(name, int_id, str(path))


@pytest.mark.parametrize(
    "config",
    [
        dict(rank=4, alpha=16),
        dict(rank=8, alpha=8, use_rslora=True),
        dict(rank=4, alpha=12, targets=["q_proj", "down_proj"], rank_pattern={"down_proj": 2}),
    ],
)
def test_weights_are_peft_modules_with_scaling_folded_into_b(tmp_path, base, config):
    peft = make_adapter(base, tmp_path, seed=3, **config)
    adapter = read_adapter(request(tmp_path), targets_of(base), max_rank=8)
    expected = {}
    for name, module in peft.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            key = (layer, ".".join(parts[-2:]))
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight * module.scaling["default"]
            expected[key] = (a, b)
    assert set(adapter.weights) == set(expected)
    for key, (a, b) in expected.items():
        torch.testing.assert_close(adapter.weights[key][0], a, rtol=0, atol=0)
        torch.testing.assert_close(adapter.weights[key][1], b, rtol=1e-7, atol=0)
    rslora = config.get("use_rslora", False)
    r = config["rank"]
    scaling = config["alpha"] / (math.sqrt(r) if rslora else r)
    lora_modules = [m for m in peft.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert scaling in {m.scaling["default"] for m in lora_modules}
    assert adapter.rank == r


def test_rank_above_max_lora_rank_is_refused(tmp_path, base):
    make_adapter(base, tmp_path, rank=8)
    with pytest.raises(AdapterError, match=r"'a' .*rank 8 exceeds max_lora_rank=4"):
        read_adapter(request(tmp_path), targets_of(base), max_rank=4)


def test_an_adapter_of_another_base_model_is_refused(tmp_path, base):
    other = build_hf_model("llama_6h3kv", vocab_size=VOCAB)
    make_adapter(other, tmp_path)
    with pytest.raises(AdapterError, match="trained on another base model"):
        read_adapter(request(tmp_path), targets_of(base), max_rank=16)


def test_unknown_target_module_is_refused(tmp_path, base):
    make_adapter(base, tmp_path, targets=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match="lora_A / lora_B weight of a decoder layer|unknown"):
        read_adapter(request(tmp_path), targets_of(base), max_rank=16)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="lora_only"), "bias"),
    ],
)
def test_what_peft_writes_but_the_engine_does_not_run_is_refused(tmp_path, base, config, match):
    make_adapter(base, tmp_path, **config)
    with pytest.raises(AdapterError, match=match):
        read_adapter(request(tmp_path), targets_of(base), max_rank=16)


def test_missing_and_broken_files_are_refused_with_the_adapters_name(tmp_path, base):
    targets = targets_of(base)
    with pytest.raises(AdapterError, match=r"adapter 'a' .*no such folder"):
        read_adapter(request(tmp_path / "nowhere"), targets, 16)
    make_adapter(base, tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="cannot be read"):
        read_adapter(request(tmp_path), targets, 16)
    weights.unlink()
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(AdapterError, match="only adapter_model.bin"):
        read_adapter(request(tmp_path), targets, 16)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not JSON"):
        read_adapter(request(tmp_path), targets, 16)
    (tmp_path / "adapter_config.json").write_text(" " * (2 << 20))
    with pytest.raises(AdapterError, match="over"):
        read_adapter(request(tmp_path), targets, 16)
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter(request(tmp_path), targets, 16)


def test_lora_alpha_must_be_positive(tmp_path, base):
    make_adapter(base, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["lora_alpha"] = 0
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="lora_alpha"):
        read_adapter(request(tmp_path), targets_of(base), 16)


def test_registry_reads_once_and_refuses_an_id_reused_for_another_folder(tmp_path, base):
    make_adapter(base, tmp_path / "x")
    make_adapter(base, tmp_path / "y", seed=1)
    registry = AdapterRegistry(targets_of(base), 16)
    first = registry.get(request(tmp_path / "x"))
    assert registry.get(request(tmp_path / "x", name="other name")) is first
    assert "already names" in registry.check(request(tmp_path / "y"))
    assert registry.check(request(tmp_path / "y", int_id=2)) is None


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match=">= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(TypeError):
        LoRARequest("a", "1", "/x")  # type: ignore[arg-type]
