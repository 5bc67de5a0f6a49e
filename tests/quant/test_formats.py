"""Quantized HF checkpoints of each format load into batchpage's IntWeight exactly, and run.

Each case writes a tiny random Llama's linears in the format's own layout (tests/quant/
packers.py), loads the folder through batchpage's loader, and checks every quantized linear's
IntWeight against the dequantized weight the packer started from, element by element in
float64: a transposed nibble order, a wrong zero point or a group off by one changes them. The
model then runs greedy against HF transformers given the same dequantized weights in float32.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchpage.model.config import UnsupportedModelError
from batchpage.model.loader import load_model, resolve_model_source
from batchpage.model.quant_layout import linears
from tests.model_factory import (
    build_hf_model,
    hf_greedy,
    hf_logits,
    paged_greedy,
    prefill_logits,
    save_hf_folder,
)
from tests.quant import packers

PROMPTS = ([5, 17, 33, 2, 90, 41, 7], [100, 3, 3, 250, 12])


def ct_config(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config of one config group over every Linear."""
    group = {"targets": ["Linear"], "weights": weights}
    if activations is not None:
        group["input_activations"] = activations
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def int4_group32(sym: bool) -> dict:
    return {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": 32}


def fp8_config(**kw) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "modules_to_not_convert": ["lm_head"], **kw}


def ct_fp8_weights(strategy: str, **kw) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, **kw}


FP8_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
BLOCK = (24, 40)  # blocks that divide neither the tiny model's rows (32, 64, 96) nor inputs

# name -> (quantization_config, packer(quantized) -> tensors, quantize kwargs: packers.quantize
# unless they name a quantizer)
CASES = {
    "gptq4_sym_g32": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
        lambda qz: packers.gptq_tensors(qz, 4, v1=True),
        dict(bits=4, group=32, sym=True),
    ),
    "gptq4_asym_desc_act_v2": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 32,
            "sym": False,
            "desc_act": True,
            "checkpoint_format": "gptq_v2",
        },
        lambda qz: packers.gptq_tensors(qz, 4, v1=False),
        dict(bits=4, group=32, sym=False, act_order=True),
    ),
    "gptq4_asym_v1": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
        lambda qz: packers.gptq_tensors(qz, 4, v1=True),
        dict(bits=4, group=32, sym=False),
    ),
    "gptq8_channel": (
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True, "desc_act": False},
        lambda qz: packers.gptq_tensors(qz, 8, v1=True),
        dict(bits=8, group=None, sym=True),
    ),
    "awq4_g32": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        packers.awq_tensors,
        dict(bits=4, group=32, sym=False),
    ),
    "ct_int4_sym_g32": (
        ct_config("pack-quantized", int4_group32(sym=True)),
        lambda qz: packers.compressed_tensors(qz, 4, sym=True),
        dict(bits=4, group=32, sym=True),
    ),
    "ct_int4_asym_g32": (
        ct_config("pack-quantized", int4_group32(sym=False)),
        lambda qz: packers.compressed_tensors(qz, 4, sym=False),
        dict(bits=4, group=32, sym=False),
    ),
    "ct_int8_channel": (
        ct_config("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}),
        lambda qz: packers.compressed_tensors(qz, 8, sym=True),
        dict(bits=8, group=None, sym=True),
    ),
    "ct_w8a8": (
        ct_config(
            "int-quantized",
            {"num_bits": 8, "type": "int", "strategy": "channel"},
            {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True},
        ),
        packers.compressed_int8,
        dict(bits=8, group=None, sym=True),
    ),
    "fp8_block": (
        fp8_config(activation_scheme="dynamic", weight_block_size=list(BLOCK)),
        packers.fp8_block,
        dict(quantizer=packers.quantize_fp8, block=BLOCK),
    ),
    "fp8_tensor_static": (
        fp8_config(activation_scheme="static"),
        packers.fp8_tensor_static,
        dict(quantizer=packers.quantize_fp8, block=None),
    ),
    "ct_fp8_channel": (
        ct_config("float-quantized", ct_fp8_weights("channel"), FP8_TOKENS),
        packers.ct_fp8,
        dict(quantizer=packers.quantize_fp8, block=(1, None)),
    ),
    "ct_fp8_block": (
        ct_config("float-quantized", ct_fp8_weights("block", block_structure=list(BLOCK))),
        packers.ct_fp8,
        dict(quantizer=packers.quantize_fp8, block=BLOCK),
    ),
    # Blocks of 32 by 32: what a model whose row-parallel inputs split into whole blocks takes.
    "ct_fp8_block32": (
        ct_config("float-quantized", ct_fp8_weights("block", block_structure=[32, 32])),
        packers.ct_fp8,
        dict(quantizer=packers.quantize_fp8, block=(32, 32)),
    ),
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized(tmp_path, case: str, quantize_head: bool = False, pack=None, **shape):
    """The folder and the HF model holding the dequantized weights it stands for; `shape`:
    config overrides of the tiny Llama (hidden_size, intermediate_size, ...)."""
    config, case_pack, kwargs = CASES[case]
    pack = pack or case_pack
    hf = build_hf_model("llama_bias_untied", **shape)
    folder = save_hf_folder(hf, tmp_path / case)
    tensors = load_file(folder / "model.safetensors")
    names = [n for n in list(tensors) if n.endswith(".weight")]
    for name in names:
        prefix = name.removesuffix(".weight")
        # Linears that read the same input share GPTQ's act order, which follows that input.
        shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
        leaf = prefix.rsplit(".", 1)[-1]
        seed = zlib.crc32((prefix.removesuffix(leaf) + shared_input.get(leaf, leaf)).encode())
        quantized = prefix.rsplit(".", 1)[-1] in LINEARS or (quantize_head and prefix == "lm_head")
        if not quantized:
            continue
        options = dict(kwargs)
        quantizer = options.pop("quantizer", None)
        if quantizer is None:
            qz = packers.quantize(tensors.pop(name), seed=seed, **options)
        else:
            qz = quantizer(tensors.pop(name), **options)
        tensors.update({f"{prefix}.{leaf}": t for leaf, t in pack(qz).items()})
        hf.get_parameter(name).data.copy_(qz.dense)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if case == "ct_w8a8":  # the reference sees the activations W8A8 multiplies
        packers.quantize_linear_inputs(hf, LINEARS)
    cfg = json.loads((folder / "config.json").read_text())
    config = {**config, "lm_head": quantize_head} if config["quant_method"] == "gptq" else config
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    return folder, hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_format_loads_its_exact_weights_and_runs_as_hf_on_them(tmp_path, tokenizer, case):
    folder, hf = write_quantized(tmp_path, case)
    tokenizer.save_pretrained(folder)
    loaded = load_model(str(folder), dtype="float32")
    model = loaded.model
    quantized = {n: m for n, m in linears(model) if m.spec.scheme is not None}
    assert len(quantized) == 4 * 2  # qkv, o, gate_up, down in each of two layers
    for name, module in quantized.items():
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[-1]
        parts = {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        }
        hf_names = [
            f"model.layers.{layer}.{name.split('.')[2]}.{p}.weight"
            for p in parts.get(kind, (kind,))
        ]
        want = torch.cat([hf.get_parameter(n).detach().double() for n in hf_names])
        got = module.weights().quant.dequantize(torch.float64)
        assert torch.equal(got, want), (case, name, (got - want).abs().max())
    for prompt in PROMPTS:
        assert paged_greedy(model, prompt, 8) == hf_greedy(hf, prompt, 8), (case, prompt)
        ours = prefill_logits(model, prompt)
        torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=2e-4, rtol=2e-4)


def test_a_gptq_lm_head_loads_quantized(tmp_path, tokenizer):
    folder, hf = write_quantized(tmp_path, "gptq4_sym_g32", quantize_head=True)
    tokenizer.save_pretrained(folder)
    model = load_model(str(folder), dtype="float32").model
    assert model.lm_head.spec.scheme is not None
    want = hf.get_parameter("lm_head.weight").detach().double()
    assert torch.equal(model.lm_head.weights().quant.dequantize(torch.float64), want)
    assert paged_greedy(model, PROMPTS[0], 8) == hf_greedy(hf, PROMPTS[0], 8)


def test_awq_packed_in_plain_order_is_not_read_as_awq(tmp_path, tokenizer):
    """AWQ interleaves a word's nibbles (0, 2, 4, 6, 1, 3, 5, 7): a file packed in plain order
    loads other weights than the ones it was made from, which the equality check catches."""

    def plain(qz):
        tensors = packers.awq_tensors(qz)
        tensors["qweight"] = packers.pack_words(qz.q.t().contiguous(), 4)
        return tensors

    folder, hf = write_quantized(tmp_path, "awq4_g32", pack=plain)
    tokenizer.save_pretrained(folder)
    model = load_model(str(folder), dtype="float32").model
    got = model.layers[0].self_attn.o_proj
    want = hf.get_parameter("model.layers.0.self_attn.o_proj.weight").detach().double()
    assert not torch.equal(got.weights().quant.dequantize(torch.float64), want)


def test_act_orders_that_differ_within_a_merged_linear_are_refused(tmp_path, tokenizer):
    config, pack, kwargs = CASES["gptq4_asym_desc_act_v2"]
    folder, _ = write_quantized(tmp_path, "gptq4_asym_desc_act_v2")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # a permutation of its own
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj: .*different act orders"):
        load_model(str(folder), dtype="float32")


def test_quantized_tensors_no_linear_takes_are_refused_before_loading(tmp_path, tokenizer):
    folder, _ = write_quantized(tmp_path, "gptq4_sym_g32")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.embed_tokens.qweight"] = torch.zeros(8, 320, dtype=torch.int32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    with pytest.raises(UnsupportedModelError, match="embed_tokens.*only as float weights"):
        resolve_model_source(str(folder))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("transpose", r"q_proj.weight_scale_inv has shape \(2, 3\), but blocks of 24 x 40"),
        ("bfloat16", r"q_proj.weight is torch.bfloat16, not float8_e4m3fn"),
    ],
)
def test_fp8_tensors_that_do_not_match_the_config_are_refused(tmp_path, tokenizer, edit, match):
    """A block scale stored transposed (as many values, the wrong blocks) or a weight that is not
    FP8 is refused, naming the tensor, rather than loaded as other weights."""
    folder, _ = write_quantized(tmp_path, "fp8_block")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    if edit == "transpose":
        tensors[f"{name}.weight_scale_inv"] = tensors[f"{name}.weight_scale_inv"].t().contiguous()
    else:
        tensors[f"{name}.weight"] = tensors[f"{name}.weight"].bfloat16()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=match):
        load_model(str(folder), dtype="float32")
