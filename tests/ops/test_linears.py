"""The linear methods (batchpage/ops): oneDNN's and the bf16 kernel's layers against F.linear,
every family bound to each against HF transformers and its unbound self, the engine's
linear_backend choice, and the same greedy tokens through the engine with each."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchpage import LLM, SamplingParams
from batchpage.cpu_info import cpu_flags
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.layers import GatedMLP
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.ops.bf16_linear import Bf16DotLinear, Bf16SiluMulLinear, bf16_linears
from batchpage.ops.f32_linear import F32KernelLinear
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear import Linear
from batchpage.ops.linear_method import TORCH_LINEARS, torch_int_linear
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, OneDnnLinear, onednn_packs
from batchpage.ops.select import ModelOps, select_linears
from tests.gemma_factory import GEMMA_VARIANTS, build_gemma
from tests.kernels.bench_smoke import markdown_tables, run_bench
from tests.kernels.test_cpu_bf16_linear import NATIVE, best_kernel
from tests.model.test_families import prefill_logits, random_ids
from tests.model_factory import (
    VARIANTS,
    build_hf_model,
    hf_greedy,
    hf_logits,
    paged_greedy,
)

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_packs(torch.float32, CPU), reason="this torch has no oneDNN float32 linears"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    layer = OneDnnLinear(w, b)
    x = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # Leading batch dims and a strided (column-sliced) input, as q/k/v views hand it.
    x3 = torch.randn(2, rows, 160, generator=g)[..., ::2]
    torch.testing.assert_close(layer(x3), F.linear(x3, w, b), atol=1e-5, rtol=1e-5)
    # The layer owns a copy: later writes to the source weight do not reach it.
    w.zero_()
    assert layer(x).abs().sum() > 0


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_apply_writes_f_linear_into_the_buffer(dtype, bias):
    """The torch method's Linear: `apply` fills the buffer it is given with exactly F.linear's
    values (the same addmm / mm), and makes its own tensor without one."""
    g = torch.Generator().manual_seed(int(bias))
    layer = Linear(40, 24, bias=bias, dtype=dtype)
    layer.weight.copy_(torch.randn(24, 40, generator=g))
    if bias:
        layer.bias.copy_(torch.randn(24, generator=g))
    x = torch.randn(9, 40, generator=g).to(dtype)
    want = F.linear(x, layer.weight, layer.bias)
    out = torch.full((9, 24), float("nan"), dtype=dtype)
    assert layer.apply(x, out) is out
    assert torch.equal(out, want)
    assert torch.equal(layer.apply(x, None), want)
    assert layer.weight_format == {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]


def _variants() -> list[str]:
    return [*VARIANTS, *GEMMA_VARIANTS]


@needs_onednn
@pytest.mark.parametrize("variant", _variants())
def test_prepacked_model_matches_transformers(tmp_path, variant):
    """Every family bound to oneDNN's linears: no dense Linear is left, prefill logits equal
    HF's and the unbound model's, and greedy decoding through the paged pool equals HF's
    generate."""
    hf = build_gemma(variant) if variant in GEMMA_VARIANTS else build_hf_model(variant)
    hf.save_pretrained(tmp_path)
    plain = load_hf_model(tmp_path, torch.float32, "cpu", 128)[0]
    packed = load_hf_model(tmp_path, torch.float32, "cpu", 128)[0]
    report = packed.bind(ModelOps(LayerOps(), ONEDNN_LINEARS))

    assert not any(isinstance(m, (nn.Linear, LoadedLinear)) for m in packed.modules())
    linears = sum(isinstance(m, LoadedLinear) for m in plain.modules())
    tied = plain.lm_head is None
    assert report.linears == linears
    assert report.weight_formats == {"f32": linears + tied}
    assert plain.weight_formats() == {"f32": linears + tied}
    table = plain.embed_tokens.weight
    assert report.extra_bytes == (table.numel() * table.element_size() if tied else 0)
    with pytest.raises(RuntimeError, match="bound already"):
        packed.bind(ModelOps(LayerOps(), ONEDNN_LINEARS))

    ids = random_ids(45, seed=1)
    ref = hf_logits(hf, ids)
    got = prefill_logits(packed, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, prefill_logits(plain, ids), atol=1e-5, rtol=0)
    prompt = random_ids(11, seed=2)
    assert paged_greedy(packed, prompt, 12) == hf_greedy(hf, prompt, 12)


def test_linear_backend_choice():
    """ "torch" never packs; "auto" measures every implementation that runs here (the bf16
    kernel where it builds and runs bf16, oneDNN exactly where it packs, torch); "onednn" packs
    or says why not; "avx512_bf16" is the kernel or says why not. oneDNN's bf16 path needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT: read from the CPU flags
    here, independently of the probe that packs a tiny weight."""
    flags = cpu_flags()
    bf16_isa = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    cpu_onednn = torch.backends.mkldnn.is_available()
    assert onednn_packs(torch.float32, CPU) == cpu_onednn
    assert onednn_packs(torch.bfloat16, CPU) == (cpu_onednn and bf16_isa)
    assert not onednn_packs(torch.float32, torch.device("cuda"))
    for dtype in (torch.float32, torch.bfloat16):
        assert select_linears("torch", dtype, CPU) == (TORCH_LINEARS, None)
        auto, measured = select_linears("auto", dtype, CPU)
        kernel = dtype == torch.bfloat16 and NATIVE  # bf16 on AVX512-BF16: the bf16 kernel
        f32 = dtype == torch.float32  # the float32 kernel builds on every CPU
        want = ["avx512_bf16"] * kernel + ["cpu_f32"] * f32
        want += ["onednn"] * onednn_packs(dtype, CPU) + ["torch"]
        assert measured is not None and list(measured.candidates) == want
        assert auto.name == "auto" and (auto.silu_mul is not None) == kernel
        # A quantized checkpoint's linears: measured among the int implementations (bf16
        # activations on AVX512-BF16 or AVX2 + FMA, float32 ones on AVX2 + FMA); on a CPU
        # without them, each weight dequantized once at bind.
        wide = {"avx2", "fma"} <= flags
        int_kernel = wide or (dtype == torch.bfloat16 and "avx512_bf16" in flags)
        assert (auto.make_int == measured.make_int) == int_kernel
        dequantizing, _ = select_linears("auto", dtype, CPU, dequantize=True)
        assert dequantizing.make_int.__qualname__.startswith("dequantized_linears")
        if int_kernel:
            assert "int_a16" in measured.int_candidates
            # the int8-activation kernel's paths, bf16 or float32 rows: VNNI's where the CPU
            # has it, AVX2's on every AVX2 CPU (measured against VNNI's where both run)
            assert ("int_a8" in measured.int_candidates) == ("avx512_vnni" in flags)
            assert ("int_a8_avx2" in measured.int_candidates) == wide
            onednn_int8 = dtype == torch.bfloat16 and cpu_onednn  # it takes bf16 rows
            assert ("onednn_int8" in measured.int_candidates) <= onednn_int8
        else:
            assert auto.make_int.__qualname__.startswith("dequantized_linears")
        if kernel:
            forced, report = select_linears("avx512_bf16", dtype, CPU)
            assert report.forced and forced.make.func is Bf16DotLinear
            assert forced.silu_mul.func is Bf16SiluMulLinear
            assert forced.make_int == report.make_int  # int layers measured all the same
        else:
            with pytest.raises(ValueError, match="linear_backend='avx512_bf16' needs bfloat16"):
                select_linears("avx512_bf16", dtype, CPU)
        if f32:
            forced, report = select_linears("cpu_f32", dtype, CPU)
            assert report.forced and forced.make.func is F32KernelLinear
        else:
            with pytest.raises(ValueError, match="linear_backend='cpu_f32' runs float32"):
                select_linears("cpu_f32", dtype, CPU)
        # batch_invariant: only the fixed-order kernels, the int ones too
        if f32 or kernel:
            _, report = select_linears("auto", dtype, CPU, batch_invariant=True)
            assert list(report.candidates) == ["cpu_f32" if f32 else "avx512_bf16"]
            assert not {"onednn_int8"} & set(report.int_candidates)
            if not f32:
                assert report.int_candidates and all(
                    c.batch_invariant for c in report.int_candidates.values()
                )
        else:
            with pytest.raises(ValueError, match="batch_invariant=True with bfloat16 needs"):
                select_linears("auto", dtype, CPU, batch_invariant=True)
        for name in ("torch", "onednn")[: 1 + onednn_packs(dtype, CPU)]:
            with pytest.raises(ValueError, match=f"cannot run linear_backend='{name}'"):
                select_linears(name, dtype, CPU, batch_invariant=True)
        if onednn_packs(dtype, CPU):
            onednn, report = select_linears("onednn", dtype, CPU)
            assert replace(onednn, make_int=torch_int_linear) == ONEDNN_LINEARS and report.forced
        else:
            with pytest.raises(ValueError, match="linear_backend='onednn' cannot pack"):
                select_linears("onednn", dtype, CPU)
    with pytest.raises(ValueError, match="linear_backend='avx512_bf16' needs bfloat16"):
        select_linears("avx512_bf16", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(
        ValueError, match="linear_backend must be one of auto, avx512_bf16, cpu_f32, onednn, torch"
    ):
        select_linears("mkl", torch.float32, CPU)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LLM("smollm2", linear_backend="mkl")


@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_dot_linear_matches_f_linear(rows, bias):
    """Bf16DotLinear (the AVX512-BF16 kernel, or its portable build on other CPUs) against
    F.linear in float64 over the same bf16 inputs: one bf16 rounding apart at most; `apply`
    writes into the buffer it is given."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 40, generator=g).to(torch.bfloat16)
    b = torch.randn(72, generator=g).to(torch.bfloat16) if bias else None
    layer = Bf16DotLinear(w, b, best_kernel())
    x = torch.randn(2, rows, 40, generator=g).to(torch.bfloat16)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(layer(x).float(), ref.float(), rtol=2**-8, atol=1e-4)
    assert layer.bias is None or layer.bias.dtype == torch.float32
    out = torch.full((rows, 72), float("nan"), dtype=torch.bfloat16)
    assert layer.apply(x[0], out) is out
    torch.testing.assert_close(out.float(), ref[0].float(), rtol=2**-8, atol=1e-4)
    w.zero_()  # the layer owns a packed copy
    assert layer(x).float().abs().sum() > 0


@pytest.mark.parametrize("variant", _variants())
def test_bf16_dot_model_matches_unpacked(tmp_path, variant):
    """Every family in bfloat16 with Bf16DotLinear for every linear and the lm_head, SiLU(gate) *
    up fused into the gate/up linear (not Gemma's GeGLU): prefill logits equal to the unpacked
    bf16 model's up to rounding order, and no farther than those from HF's in float32."""
    hf = build_gemma(variant) if variant in GEMMA_VARIANTS else build_hf_model(variant)
    hf.save_pretrained(tmp_path)
    plain = load_hf_model(tmp_path, torch.bfloat16, "cpu", 128)[0]
    packed = load_hf_model(tmp_path, torch.bfloat16, "cpu", 128)[0]
    report = packed.bind(ModelOps(LayerOps(), bf16_linears(best_kernel())))
    assert not any(isinstance(m, (nn.Linear, LoadedLinear)) for m in packed.modules())
    mlps = [m for m in packed.modules() if isinstance(m, GatedMLP)]
    assert all(m.gate_up_proj.activates == m.silu_gated for m in mlps)  # none in Mixtral
    assert all(
        isinstance(m.gate_up_proj, Bf16SiluMulLinear if m.silu_gated else Bf16DotLinear)
        for m in mlps
    )
    linears = sum(isinstance(m, LoadedLinear) for m in plain.modules())
    assert report.linears == linears  # the fused gate/up linears among them
    assert report.weight_formats == {"bf16": linears + (plain.lm_head is None)}
    ids = random_ids(45, seed=1)
    ref = hf_logits(hf, ids)
    got, unpacked = prefill_logits(packed, ids), prefill_logits(plain, ids)
    assert got.dtype == unpacked.dtype  # bf16, or float32 after Gemma's softcap
    scale = ref.abs().max()
    # Both sum each product in float32 and round once to bf16, in different orders, so they
    # agree to a bf16 step or two; measured: identical on every variant here. bf16 puts both
    # 1-5% of the largest logit off HF's float32 (34% for Mixtral, whose bf16 router picks
    # other experts for some tokens); the packed model must be no farther.
    assert (got.float() - unpacked.float()).abs().max() <= 0.01 * scale
    err_packed = (got.float() - ref).abs().max()
    assert err_packed <= (unpacked.float() - ref).abs().max() + 0.01 * scale


@pytest.mark.parametrize(
    ("dtype", "backend"),
    [
        pytest.param("float32", "onednn", marks=needs_onednn),
        pytest.param(
            "bfloat16",
            "avx512_bf16",
            marks=pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512-BF16"),
        ),
    ],
)
def test_engine_tokens_equal_with_and_without_packing(tiny_folder, tokenizer, dtype, backend):
    """The same greedy tokens and logprobs from the engine with linear_backend torch and a
    packed one, on a batch that mixes prefill chunks and decodes."""
    prompts = [tokenizer.encode(t) for t in ("Paged attention", "A radix tree", "def add(a")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = {}
    for choice in ("torch", backend):
        llm = LLM(str(tiny_folder), dtype=dtype, linear_backend=choice, max_num_batched_tokens=8)
        if choice != "torch":
            assert not any(isinstance(m, nn.Linear) for m in llm.engine.runner.model.modules())
        outs[choice] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs["torch"], outs[backend], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok] == pytest.approx(lb[tok], abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_linears_benchmark_measures_every_path(tiny_folder, tmp_path, dtype):
    """python -m jobs.bench.linears on the tiny model: every shape at every row count, every path
    this CPU has for the dtype timed (F.linear, oneDNN, and batchpage's kernel: in float32 its
    float32 kernel, in bf16 on AVX512-BF16 its bf16 kernel), hot and cold, the same products as
    F.linear."""
    import json

    if not onednn_packs(getattr(torch, dtype), CPU):
        pytest.skip(f"oneDNN cannot pack {dtype} here")
    out = tmp_path / "linears.json"
    done = run_bench(
        "jobs.bench.linears", "--model", str(tiny_folder), "--dtype", dtype, "--rows", "1,8",
        "--repeats", "2", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["linear"]) for r in rows] == [
        (m, name)
        for m in (1, 8)
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    ]
    own = {"float32": "f32_kernel", "bfloat16": "bf16_kernel" if NATIVE else None}[dtype]
    paths = ["onednn"] + ([own] if own else [])
    timed = ["f_linear_ms"] + [f"{p}{c}_ms" for p in paths for c in ("", "_cold")]
    assert all(sorted(k for k in r if k.endswith("_ms")) == sorted(timed) for r in rows)
    assert all(r[k] > 0 for r in rows for k in timed)
    # float32: summation order only; bf16: a rounding step of outputs of order 1 at most
    tolerance = 1e-4 if dtype == "float32" else 0.02
    assert all(r[f"{p}_max_abs_diff"] < tolerance for r in rows for p in paths)
    assert "| rows | linear |" in done.stdout
    label = {"f32_kernel": "float32 kernel", "bf16_kernel": "bf16 kernel", None: "-"}[own]
    assert (f"{label} vs oneDNN, cold" in done.stdout) == (own is not None)


def test_step_profile_counts_every_linear_backend_as_linears(tmp_path):
    """python -m jobs.bench.step_profile --samples on a py-spy raw file: frames of every linear
    method land in the linears bucket, not in the kernels' (attention) or the model's
    catch-alls, the lm_head's in its own; samples outside LLM.generate, or in the callback that
    starts and stops py-spy, do not count."""
    run = "generate (batchpage/llm.py:63);step (batchpage/engine/engine.py:120)"
    layer = f"{run};forward (batchpage/model/layers.py:90)"
    head = f"{run};compute_logits (batchpage/model/causal_lm.py:98)"
    inners = [
        "forward (torch/nn/modules/linear.py:125)",
        "apply (batchpage/ops/linear.py:60)",
        "apply (batchpage/ops/onednn_linear.py:34)",
        "apply (batchpage/ops/bf16_linear.py:58)",
    ]
    lines = [f"{layer};{inner} 3" for inner in inners] + [f"{head};{inners[2]} 4"]
    lines += [f"{layer};paged_decode (batchpage/kernels/cpu_paged_decode.py:70) 5"]
    lines += ["<module> (x.py:1);sleep (time.py:1) 100"]  # outside generate
    lines += [f"{run};on_step (jobs/bench/step_profile.py:90);sleep (time.py:1) 100"]
    samples = tmp_path / "spy.txt"
    samples.write_text("\n".join(lines) + "\n")
    done = run_bench("jobs.bench.step_profile", "--samples", str(samples))
    assert done.returncode == 0, done.stderr
    (table,) = markdown_tables(done.stdout)
    share = {row["share of a decode step"]: row["spy.txt"] for row in table}
    assert share["linears"] == f"{12 / 21:.1%}"
    assert share["lm_head"] == f"{4 / 21:.1%}"
    assert share["attention"] == f"{5 / 21:.1%}"
    assert share["outside the step"] == "0.0%"
