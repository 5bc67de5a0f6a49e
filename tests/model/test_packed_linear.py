"""oneDNN-prepacked linears (model/packed_linear.py): the layer against F.linear, every family's
prepacked model against HF transformers, the engine's linear_backend choice, and the same greedy
tokens through the engine with and without packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchpage import LLM, SamplingParams
from batchpage.cpu_info import cpu_flags
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.packed_linear import PackedLinear, onednn_packs, use_onednn
from tests.gemma_factory import GEMMA_VARIANTS, build_gemma
from tests.model.test_families import prefill_logits, random_ids
from tests.model_factory import VARIANTS, build_hf_model, hf_greedy, hf_logits, paged_greedy

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
    layer = PackedLinear(w, b)
    x = torch.randn(rows, 80, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # Leading batch dims and a strided (column-sliced) input, as q/k/v views hand it.
    x3 = torch.randn(2, rows, 160, generator=g)[..., ::2]
    torch.testing.assert_close(layer(x3), F.linear(x3, w, b), atol=1e-5, rtol=1e-5)
    # The layer owns a copy: later writes to the source weight do not reach it.
    w.zero_()
    assert layer(x).abs().sum() > 0


def _variants() -> list[str]:
    return [*VARIANTS, *GEMMA_VARIANTS]


@needs_onednn
@pytest.mark.parametrize("variant", _variants())
def test_prepacked_model_matches_transformers(tmp_path, variant):
    """Every family: after prepack_linears no nn.Linear is left, prefill logits equal HF's and
    the unpacked model's, and greedy decoding through the paged pool equals HF's generate."""
    hf = build_gemma(variant) if variant in GEMMA_VARIANTS else build_hf_model(variant)
    hf.save_pretrained(tmp_path)
    plain = load_hf_model(tmp_path, torch.float32, "cpu", 128)[0]
    packed = load_hf_model(tmp_path, torch.float32, "cpu", 128)[0]
    report = packed.prepack_linears()

    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    linears = sum(isinstance(m, nn.Linear) for m in plain.modules())
    tied = plain.lm_head is None
    assert report.packed == linears + tied
    table = plain.embed_tokens.weight
    assert report.extra_bytes == (table.numel() * table.element_size() if tied else 0)
    assert packed.prepack_linears().packed == 0  # a second call finds nothing left to pack

    ids = random_ids(45, seed=1)
    ref = hf_logits(hf, ids)
    got = prefill_logits(packed, ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, prefill_logits(plain, ids), atol=1e-5, rtol=0)
    prompt = random_ids(11, seed=2)
    assert paged_greedy(packed, prompt, 12) == hf_greedy(hf, prompt, 12)


def test_linear_backend_choice():
    """ "torch" never packs; "auto" packs exactly where oneDNN can; "onednn" packs or says why
    not. oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: read from the CPU flags
    here, independently of the probe that packs a tiny weight."""
    flags = cpu_flags()
    bf16_isa = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    cpu_onednn = torch.backends.mkldnn.is_available()
    assert onednn_packs(torch.float32, CPU) == cpu_onednn
    assert onednn_packs(torch.bfloat16, CPU) == (cpu_onednn and bf16_isa)
    assert not onednn_packs(torch.float32, torch.device("cuda"))
    for dtype in (torch.float32, torch.bfloat16):
        assert not use_onednn("torch", dtype, CPU)
        assert use_onednn("auto", dtype, CPU) == onednn_packs(dtype, CPU)
        if onednn_packs(dtype, CPU):
            assert use_onednn("onednn", dtype, CPU)
        else:
            with pytest.raises(ValueError, match="linear_backend='onednn' cannot pack"):
                use_onednn("onednn", dtype, CPU)
    with pytest.raises(ValueError, match="linear_backend must be one of auto, onednn, torch"):
        use_onednn("mkl", torch.float32, CPU)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        LLM("smollm2", linear_backend="mkl")


@needs_onednn
def test_engine_tokens_equal_with_and_without_packing(tiny_folder, tokenizer):
    """The same greedy tokens and logprobs from the engine with linear_backend torch and onednn,
    on a batch that mixes prefill chunks and decodes."""
    prompts = [tokenizer.encode(t) for t in ("Paged attention", "A radix tree", "def add(a")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "onednn"):
        llm = LLM(str(tiny_folder), linear_backend=backend, max_num_batched_tokens=8)
        if backend == "onednn":
            assert not any(isinstance(m, nn.Linear) for m in llm.engine.runner.model.modules())
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs["torch"], outs["onednn"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok] == pytest.approx(lb[tok], abs=1e-4)


@needs_onednn
def test_linears_benchmark_measures_both_paths(tiny_folder, tmp_path, capsys):
    """jobs/bench/linears.py on the tiny model: every shape at every row count, both paths
    timed, the same products."""
    import json

    from jobs.bench import linears

    out = tmp_path / "linears.json"
    linears.main(
        ["--model", str(tiny_folder), "--rows", "1,8", "--repeats", "2", "--out", str(out)]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["linear"]) for r in rows] == [
        (m, name)
        for m in (1, 8)
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    ]
    assert all(
        r["f_linear_ms"] > 0 and r["onednn_ms"] > 0 and r["onednn_cold_ms"] > 0 for r in rows
    )
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)
    assert "| rows | linear |" in capsys.readouterr().out
