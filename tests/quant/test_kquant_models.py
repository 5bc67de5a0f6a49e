"""A whole model of GGUF K-quants (Q4_K, Q5_K, Q6_K) through the API and the job.

tests/fixtures/kquant_mix.gguf was quantized by llama.cpp's llama-quantize (the gguf package
cannot write K-quants; tests/fixtures/make_kquant_gguf.py made it): each type runs in each kind
of linear in some layer, one merged q/k/v mixes Q4_K and Q6_K, and the tied head is Q6_K. The
reference is HF transformers in float32 holding the file's tensors as the gguf package's own
dequantize decodes them, its Llama q/k rows put back in HF's order."""

from __future__ import annotations

import json
import subprocess

import gguf
import pytest
import torch
import torch.nn.functional as F

from batchpage import LLM, SamplingParams
from batchpage.ops.dequantized_linear import DequantizedLinear
from tests.fixtures.make_kquant_gguf import (
    FIXTURE,
    SIZES,
    VARIANT,
    expected_types,
    file_types,
)
from tests.job.test_loop import table
from tests.job.test_run_cli import cli, tiny_job_args
from tests.model_factory import (
    build_hf_model,
    gguf_name,
    hf_greedy,
    hf_logits,
    llama_cpp_unpermute,
    tiny_tokenizer,
)
from tests.quant.test_engine import WIDE, int_layers_as_reported, needs_kernel

TEXTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "A radix tree shares prefixes",
    "Hello world! 0123",
]
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=1)
ENGINE = dict(dtype="float32", kv_cache_memory=2**22, max_model_len=256)
# The linears by the type they run in: 3 layers x (q/k/v, o, gate/up, down), and the tied head.
FORMATS = {"q4_k": 3, "q5_k": 4, "q6_k": 5, "q4_k+q6_k": 1}


@pytest.fixture(scope="module")
@torch.no_grad()
def reference():
    """HF's float32 Llama of the fixture's config holding the file's dequantized tensors."""
    hf = build_hf_model(VARIANT, vocab_size=len(tiny_tokenizer()), **SIZES)
    cfg = hf.config
    tensors = {t.name: t for t in gguf.GGUFReader(FIXTURE).tensors}
    for name, p in hf.named_parameters():
        if name == "lm_head.weight":
            continue  # tied: the embedding's
        t = tensors[gguf_name(name)]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(p.shape)
        if ".q_proj." in name or ".k_proj." in name:
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = llama_cpp_unpermute(w, heads)
        p.copy_(torch.from_numpy(w.copy()))
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def test_the_fixture_holds_each_k_quant_where_its_script_says() -> None:
    assert file_types(FIXTURE) == expected_types()
    assert FIXTURE.stat().st_size < 1_000_000


@pytest.mark.parametrize("packed", [True, False])
def test_a_kquant_gguf_generates_hfs_greedy_tokens_of_its_dequantized_weights(
    reference, packed: bool
) -> None:
    """quantized_weights=True: each linear's K-quant blocks stay packed on the int kernel (its
    float32 tiles, where the CPU has AVX2 + FMA); False: dequantized at load. Either way the
    file's own tokenizer encodes as the tests' tokenizer, and the tokens and their logprobs are
    HF's."""
    llm = LLM(str(FIXTURE), quantized_weights=packed, block_size=4, **ENGINE)
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    tokenizer = tiny_tokenizer()
    for out, text in zip(outs, TEXTS, strict=True):
        prompt = tokenizer.encode(text)
        assert out.prompt_token_ids == prompt
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(reference, prompt, MAX_NEW), text
        logprobs = F.log_softmax(hf_logits(reference, prompt + got.token_ids[:-1]), dim=-1)
        for i, (token, lp) in enumerate(zip(got.token_ids, got.logprobs, strict=True)):
            assert abs(lp[token] - logprobs[len(prompt) - 1 + i, token].item()) < 1e-3
    formats = llm.stats["weight_formats"]
    if not packed:
        assert formats == {"f32": 13}
    elif WIDE:
        assert formats == FORMATS
        assert int_layers_as_reported(llm) == ["int_a16"] * 13
        methods = llm.stats["linear_methods"]  # by format:shape, each shape's choice
        assert {key.split(":")[0] for key in methods} == set(FORMATS)
        assert set(methods.values()) == {"int_a16"}
    else:  # dequantized once at bind
        held = [m for m in llm.engine.runner.model.modules() if isinstance(m, DequantizedLinear)]
        assert len(held) == 13 and formats["f32"] >= 13


@needs_kernel
def test_a_bf16_engine_runs_each_k_quant_on_the_int_kernel(reference) -> None:
    """bf16 activations on the A16 kernel: HF's float32 first tokens, as for the other formats
    (tests/quant/test_engine.py)."""
    llm = LLM(str(FIXTURE), dtype="bfloat16", quantized_weights=True, block_size=4,
              kv_cache_memory=2**22, max_model_len=256)  # fmt: skip
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    tokenizer = tiny_tokenizer()
    for out, text in zip(outs, TEXTS, strict=True):
        assert out.outputs[0].token_ids[:2] == hf_greedy(reference, tokenizer.encode(text), 2)
    assert llm.stats["weight_formats"] == FORMATS
    assert int_layers_as_reported(llm) == ["int_a16"] * 13


def test_a_job_on_a_kquant_gguf_writes_llm_generates_rows(tmp_path) -> None:
    """`python -m batchpage.run` with the K-quant file as the model: each row's completion is
    LLM.generate's for its prompt."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    out = tmp_path / "out"
    args = [*tiny_job_args(data, FIXTURE, out), "engine.quantized_weights=true",
            f"sampling.max_tokens={MAX_NEW}", "sampling.ignore_eos=true"]  # fmt: skip
    proc = cli(args, tmp_path, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    rows = table(out)
    llm = LLM(str(FIXTURE), quantized_weights=True, **ENGINE)
    want = llm.generate(TEXTS, GREEDY.replace(logprobs=None), use_tqdm=False)
    assert [r["completion"] for r in rows] == [o.outputs[0].text for o in want]
    assert [r["finish_reason"] for r in rows] == ["length"] * len(TEXTS)
    assert all(r["error"] is None for r in rows)
