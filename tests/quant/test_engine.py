"""A quantized checkpoint through the engine: bound to the C++ int kernels on a bf16 CPU engine,
reporting what it holds, and computing what the dequantized model computes; with the engine
option int8_activations, what the dequantized model computes from int8-rounded inputs."""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.cpu_info import cpu_flags
from batchpage.kernels.cpu_int_linear import CpuIntLinear
from batchpage.ops.dequantized_linear import DequantizedLinear
from batchpage.ops.int_linear import A8_NAMES, CpuA8LinearOp, CpuIntLinearOp
from batchpage.ops.linear import dtype_format
from batchpage.ops.onednn_int8_linear import OneDnnInt8Linear
from batchpage.ops.quant_linear import QuantLinear
from tests.model_factory import hf_greedy
from tests.quant import packers
from tests.quant.test_formats import LINEARS, PROMPTS, write_quantized

needs_kernel = pytest.mark.skipif(
    "avx512_bf16" not in cpu_flags() and not {"avx2", "fma"} <= cpu_flags(),
    reason="the int kernel runs on AVX512-BF16 or AVX2 CPUs",
)
# Each int implementation's layer type, by the name linear_methods gives its choice (the
# int8-activation kernel's paths, "int_a8" and "int_a8_avx2", are one type: A8_NAMES[op.path]).
INT_OPS = {
    "int_a16": CpuIntLinearOp,
    "int_a8": CpuA8LinearOp,
    "int_a8_avx2": CpuA8LinearOp,
    "onednn_int8": OneDnnInt8Linear,
}


def int_layers_as_reported(llm: LLM) -> list[str]:
    """The int layers' implementation names, each checked against llm.stats' choice for its
    shape (the measured fastest: which one depends on the CPU)."""
    model = llm.engine.runner.model
    ints = [m for m in model.modules() if isinstance(m, tuple(INT_OPS.values()))]
    chosen = set(llm.stats["linear_methods"].values()) & set(INT_OPS)
    assert {type(m) for m in ints} == {INT_OPS[name] for name in chosen}
    return [
        A8_NAMES[m.path]
        if isinstance(m, CpuA8LinearOp)
        else next(n for n, t in INT_OPS.items() if isinstance(m, t))
        for m in ints
    ]


def engine(folder, **kw) -> LLM:
    return LLM(model=str(folder), block_size=4, max_model_len=64, kv_cache_memory=2**22, **kw)


@needs_kernel
@pytest.mark.parametrize(
    "case", ["gptq4_asym_desc_act_v2", "awq4_g32", "ct_int8_channel", "ct_w8a8"]
)
def test_a_bf16_cpu_engine_runs_quantized_linears_on_the_int_kernel(tmp_path, tokenizer, case):
    assert CpuIntLinear.build().path != "plain"
    folder, hf = write_quantized(tmp_path, case)
    tokenizer.save_pretrained(folder)
    llm = engine(folder, dtype="bfloat16", quantized_weights=True)  # never held dense
    model = llm.engine.runner.model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    # Weight-only schemes on the A16 kernel; W8A8 on whichever int8-activation one is fastest.
    names = int_layers_as_reported(llm)
    assert len(names) == 8 and (case == "ct_w8a8" or set(names) == {"int_a16"})
    # bf16 activations against HF's float32 run of the dequantized weights: the tiny random
    # model's top logits are far enough apart that the first tokens agree.
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.outputs[0].token_ids[:2] == hf_greedy(hf, list(prompt), 2)
    stats = llm.stats
    fmt = {"gptq4_asym_desc_act_v2": "gptq_int4", "awq4_g32": "awq_int4", "ct_w8a8": "ct_w8a8"}
    fmt = fmt.get(case, "ct_int8")
    assert stats["weight_formats"] == {fmt: 8, "bf16": 1}
    dense = engine(save_dense(tmp_path, hf, tokenizer), dtype="bfloat16")
    assert stats["weight_bytes"] < dense.engine.weight_bytes
    assert dense.engine.bind_report.weight_formats == {"bf16": 9}


def save_dense(tmp_path, hf, tokenizer):
    from tests.model_factory import save_hf_folder

    folder = save_hf_folder(hf, tmp_path / "dense")
    tokenizer.save_pretrained(folder)
    return folder


WIDE = {"avx2", "fma"} <= cpu_flags()  # the int kernel's float32 tiles run here


@pytest.mark.parametrize("case", ["gptq4_sym_g32", "ct_int4_asym_g32", "ct_w8a8"])
@pytest.mark.parametrize("packed", [True, False])
def test_a_float32_engine_runs_quantized_linears_as_hf_runs_the_dequantized_model(
    tmp_path, tokenizer, case, packed
):
    """quantized_weights=True: the weights stay packed, multiplied by the int kernel's float32
    tiles (float32 rows in and out) where the CPU has AVX2 + FMA, else dequantized once at
    bind; False: dequantized as they load. Either way HF's greedy tokens of the dequantized
    model."""
    folder, hf = write_quantized(tmp_path, case)
    tokenizer.save_pretrained(folder)
    llm = engine(folder, dtype="float32", quantized_weights=packed)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, list(prompt), 8)
    model = llm.engine.runner.model
    if packed and WIDE:
        # W8A8: whichever measures fastest (the int8-activation kernel takes float32 rows too)
        allowed = {"int_a16", *A8_NAMES.values()} if case == "ct_w8a8" else {"int_a16"}
        names = int_layers_as_reported(llm)
        assert len(names) == 8 and set(names) <= allowed, names
        ints = [m for m in model.modules() if isinstance(m, (CpuIntLinearOp, CpuA8LinearOp))]
        assert len(ints) == 8 and all(m.dtype == torch.float32 for m in ints)
        fmt = {"gptq4_sym_g32": "gptq_int4", "ct_int4_asym_g32": "ct_int4", "ct_w8a8": "ct_w8a8"}
        assert llm.stats["weight_formats"][fmt[case]] == 8
        return
    if not packed:  # dense from the load on
        assert set(llm.stats["weight_formats"]) == {"f32"}
        return
    held = [m for m in model.modules() if isinstance(m, DequantizedLinear)]
    assert len(held) == 8 and all(m.weight_format == "f32" for m in held)
    assert all(m.rounds_rows == (case == "ct_w8a8") for m in held)
    assert llm.stats["weight_formats"]["f32"] >= 8


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_kernel)])
@pytest.mark.parametrize("case", ["gptq4_asym_desc_act_v2", "ct_int8_channel"])
def test_int8_activations_compute_the_dequantized_model_on_int8_rounded_inputs(
    tmp_path, tokenizer, case, dtype
):
    """W4A8 / W8A8 for weight-only checkpoints: the int8-activation kernel (or the A16 one fed
    int8 values) quantizes each row, or, in float32 without AVX2, the layer dequantized at bind
    does in torch; both against HF's float32 run of the dequantized weights whose linears see
    int8-rounded rows."""
    folder, hf = write_quantized(tmp_path, case)
    tokenizer.save_pretrained(folder)
    packers.quantize_linear_inputs(hf, LINEARS)
    llm = engine(folder, dtype=dtype, int8_activations=True, quantized_weights=True)
    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    packed = dtype == "bfloat16" or WIDE  # float32 rows: the int kernel's float32 tiles
    if packed:
        assert len(int_layers_as_reported(llm)) == 8
    else:
        held = [m for m in model.modules() if isinstance(m, DequantizedLinear)]
        assert len(held) == 8 and all(m.rounds_rows for m in held)
    agree = 6 if dtype == "float32" else 2  # bf16 activations: the first tokens, as above
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.outputs[0].token_ids[:agree] == hf_greedy(hf, list(prompt), agree)
    fmt = {"gptq4_asym_desc_act_v2": "gptq_w4a8", "ct_int8_channel": "ct_w8a8"}[case]
    assert llm.stats["weight_formats"][fmt if packed else "f32"] >= 8


@needs_kernel
@pytest.mark.parametrize(
    "dtype",
    ["bfloat16", pytest.param("float32", marks=pytest.mark.skipif(not WIDE, reason="no AVX2"))],
)
def test_every_int8_activation_implementation_computes_the_same_model(
    tmp_path, tokenizer, monkeypatch, dtype
):
    """W8A8 per channel bound, layer by layer, to each int implementation that takes it (the
    measurement made to pick it, with a fresh choice cache) in a bf16 and a float32 engine (no
    oneDNN there: it takes bf16 rows): HF's float32 run on int8-rounded inputs for the first two
    greedy tokens from each, and the exact ones agree in all six."""
    import batchpage.ops.measured_linear as measured_linear

    folder, hf = write_quantized(tmp_path, "ct_w8a8")
    tokenizer.save_pretrained(folder)
    packers.quantize_linear_inputs(hf, LINEARS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    tokens = {}
    for name in INT_OPS:
        monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / f"cache-{name}"))
        pick = name  # the "fastest" is this one wherever it is measured
        monkeypatch.setattr(measured_linear, "fastest", lambda t, pick=pick: pick if pick in t
                            else min(t))  # fmt: skip
        llm = engine(folder, dtype=dtype)
        outs = llm.generate(prompts, params)
        names = set(int_layers_as_reported(llm))
        if names != {name}:  # this CPU cannot run it (no VNNI or AVX2, no oneDNN int8)
            assert name != "int_a16"
            continue
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        for out, prompt in zip(outs, PROMPTS, strict=True):
            assert out.outputs[0].token_ids[:2] == hf_greedy(hf, list(prompt), 2)
    # The int8-activation kernel's paths and oneDNN sum int8 products exactly and scale in
    # float32: the same tokens. The A16 kernel multiplies the int8 values by W rounded to bf16
    # (one rounding apart), which the tiny random model's close logits may show after the first
    # tokens.
    exact = [t for name, t in tokens.items() if name != "int_a16"]
    assert "int_a16" in tokens and all(t == exact[0] for t in exact)
    assert ("int_a8_avx2" in tokens) == WIDE  # the int8 path of CPUs without VNNI


@needs_kernel
@pytest.mark.parametrize("held", ["dense", "int_a16"])
def test_a_quantized_layer_held_dense_computes_what_the_dense_checkpoint_does(
    tmp_path, tokenizer, monkeypatch, held
):
    """W4A16 under linear_backend=auto, where the dense copy fits: each layer bound to what
    measurement picks (forced here to `held`, with a fresh choice cache). Held dense, the
    engine is the one of quantized_weights=false (the same dense weights: the same tokens);
    either way HF's float32 run for the first two tokens."""
    import batchpage.ops.measured_linear as measured_linear

    folder, hf = write_quantized(tmp_path, "awq4_g32")
    tokenizer.save_pretrained(folder)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(measured_linear, "fastest", lambda t: held if held in t else min(t))
    llm = engine(folder, dtype="bfloat16")
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    methods = llm.stats["linear_methods"]
    assert {v for k, v in methods.items() if k.startswith("awq_int4:")} == {held}
    if held == "dense":
        assert llm.stats["weight_formats"] == {"bf16": 9}
        plain = engine(folder, dtype="bfloat16", quantized_weights=False)
        assert outs == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    else:
        assert llm.stats["weight_formats"] == {"awq_int4": 8, "bf16": 1}
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out[:2] == hf_greedy(hf, list(prompt), 2)


@needs_kernel
def test_a_tied_quantized_head_held_dense_keeps_its_rows_for_the_lookups(tmp_path, monkeypatch):
    """The bundled model's Q8_0 table is its head and its lookups' table: held dense (forced
    here), its matmul runs on the dense copy while the lookups read the int module's rows,
    which equal the dequantized table; the engine is then the one of quantized_weights=false."""
    import batchpage.ops.measured_linear as measured_linear
    from batchpage.ops.measured_linear import DENSE, DenseWithRows

    monkeypatch.setenv("BATCHPAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(measured_linear, "fastest", lambda t: DENSE if DENSE in t else min(t))
    llm = LLM("smollm2", dtype="bfloat16", kv_cache_memory=2**24, max_model_len=256)
    model = llm.engine.runner.model
    head = model.tied_head
    assert isinstance(head, DenseWithRows) and isinstance(head.rows, CpuIntLinearOp)
    ids = torch.tensor([0, 5, 49151])
    want = head.dense.apply(torch.eye(576, dtype=torch.bfloat16), None).T[ids].float()
    torch.testing.assert_close(head.weight_rows(ids), want, rtol=2**-7, atol=1e-6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain = LLM(
        "smollm2", dtype="bfloat16", kv_cache_memory=2**24, max_model_len=256,
        quantized_weights=False,
    )  # fmt: skip
    assert outs == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert llm.stats["weight_formats"] == {"bf16": 120, "bf16+q8_0": 1}


@needs_kernel
def test_quantized_weights_true_keeps_every_layer_packed() -> None:
    """quantized_weights=True: the memory first, every quantized layer on an int kernel and
    the bundled model in under half its bf16 bytes; a value other than true, false or auto
    is refused naming them."""
    llm = LLM("smollm2", dtype="bfloat16", kv_cache_memory=2**24, quantized_weights=True)
    assert llm.engine.bind_report.weight_formats == {"q4_1": 120, "q8_0": 1}
    from batchpage.model.loader import resolve_model_source

    bf16_bytes = 2 * resolve_model_source("smollm2").num_weights  # the tied table once
    assert llm.engine.weight_bytes < 0.5 * bf16_bytes
    with pytest.raises(ValueError, match="quantized_weights must be true, false or auto"):
        LLM("smollm2", quantized_weights="packed")


def test_the_dense_form_is_offered_only_where_the_dense_copy_fits(monkeypatch) -> None:
    """dense_copy_fits: the quantized linears (the tied head among them) held dense in the
    engine's dtype must take at most 1 / DENSE_COPY_SHARE of the memory available; a model with
    no quantized linear never offers it."""
    from batchpage.engine import model_runner
    from batchpage.model.loaded_linear import LoadedLinear
    from batchpage.model.loader import load_model

    model = load_model("smollm2", dtype="bfloat16").model
    layers = [m for m in model.modules() if isinstance(m, LoadedLinear) and m.spec.scheme]
    assert len(layers) == 121 and model.tied_quant in layers
    dense = sum(m.out_features * m.in_features * 2 for m in layers)  # bf16 bytes
    cpu = torch.device("cpu")
    for free, fits in [
        (dense * model_runner.DENSE_COPY_SHARE, True),
        (dense * model_runner.DENSE_COPY_SHARE - 1, False),
    ]:
        monkeypatch.setattr(model_runner, "available_memory", lambda device, free=free: free)
        assert model_runner.dense_copy_fits(model, torch.bfloat16, cpu) == fits
    for layer in layers:
        layer.hold(None)  # dense, as a float checkpoint's
    assert not model_runner.dense_copy_fits(model, torch.bfloat16, cpu)


def test_int8_activations_need_quantized_weights():
    with pytest.raises(ValueError, match="int8_activations applies to quantized weights"):
        LLM(model="smollm2", quantized_weights=False, int8_activations=True)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_weights_are_held_in_a_byte_and_run_as_hf_on_them(tmp_path, tokenizer, dtype):
    """FP8 block weights stay float8 codes (a byte each), in the int kernel's layout (widened
    in registers, bf16 and float32 rows), and the engine decodes as HF does on the dequantized
    weights; int8_activations is refused for them."""
    folder, hf = write_quantized(tmp_path, "fp8_block")
    tokenizer.save_pretrained(folder)
    llm = engine(folder, dtype=dtype, quantized_weights=True)
    model = llm.engine.runner.model
    held = [m for m in model.modules() if isinstance(m, CpuIntLinearOp)]
    assert len(held) == 8 and all(m.q.dtype == torch.uint8 and m.kind == 9 for m in held)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    agree = 6 if dtype == "float32" else 2  # bf16 activations: the first tokens, as above
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.outputs[0].token_ids[:agree] == hf_greedy(hf, list(prompt), agree)
    assert int_layers_as_reported(llm) == ["int_a16"] * 8
    assert llm.stats["weight_formats"] == {"fp8": 8, dtype_format(getattr(torch, dtype)): 1}
    dense = engine(save_dense(tmp_path, hf, tokenizer), dtype=dtype)
    assert llm.stats["weight_bytes"] < dense.engine.weight_bytes
    with pytest.raises(ValueError, match="int8_activations needs integer weights.* fp8"):
        engine(folder, dtype=dtype, int8_activations=True)


@needs_kernel
def test_fp8_weights_under_batch_invariant_run_packed_and_alike_in_any_batch(tmp_path, tokenizer):
    """The int kernel's rows do not depend on the batch, FP8 codes included: a batch-invariant
    engine keeps them packed, and a row alone is the same bits as among others."""
    folder, _ = write_quantized(tmp_path, "fp8_block")
    tokenizer.save_pretrained(folder)
    llm = engine(folder, dtype="float32", batch_invariant=True, quantized_weights=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    target = {"prompt_token_ids": list(PROMPTS[0])}
    alone = llm.generate([target], params)[0].outputs[0]
    others = [{"prompt_token_ids": list(p)} for p in PROMPTS[1:]]
    among = llm.generate([*others, target], params)[-1].outputs[0]
    assert (among.token_ids, among.logprobs) == (alone.token_ids, alone.logprobs)
    assert int_layers_as_reported(llm) == ["int_a16"] * 8


@pytest.mark.parametrize(
    "case", ["gptq4_asym_desc_act_v2", "awq4_g32", "ct_w8a8", "fp8_block", "ct_fp8_channel"]
)
def test_the_triton_int_kernel_runs_every_format_as_hf(tmp_path, tokenizer, case):
    """A GPU's quantized linears (linear_backend=triton: here under Triton's interpreter, in
    float32): every quantized layer on the Triton int kernel, held as stored, and HF's greedy
    tokens of the dequantized weights."""
    from batchpage.ops.triton_int_linear import TritonIntLinear

    folder, hf = write_quantized(tmp_path, case)
    tokenizer.save_pretrained(folder)
    llm = engine(folder, dtype="float32", linear_backend="triton", quantized_weights=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, list(prompt), 4)
    model = llm.engine.runner.model
    assert sum(isinstance(m, TritonIntLinear) for m in model.modules()) == 8
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert set(llm.stats["linear_methods"].values()) == {"triton", "triton_int"}
