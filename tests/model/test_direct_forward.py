"""DirectForward (model/direct_forward.py) against the module path it replaces: the same kernels
in the same order, so every step's hidden states and every K/V it writes must be equal bit for
bit, on every family it applies to, through prefill, chunks, decodes and a mixed step. It runs
the bf16 linear kernel's portable build on CPUs without AVX512-BF16, so it is tested on any CPU."""

from __future__ import annotations

import functools

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.engine.model_runner import make_attention_backend
from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.model.causal_lm import CausalLM
from batchpage.model.direct_forward import DirectForward
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.packed_linear import Bf16DotLinear, Bf16SiluMulLinear, LinearPacking
from tests.gemma_factory import build_gemma
from tests.kernels.test_cpu_bf16_linear import NATIVE, best_kernel
from tests.model.test_families import random_ids
from tests.model_factory import VARIANTS, build_hf_model, new_kv_cache, step_meta

CPU = torch.device("cpu")
BLOCK = 4


def bf16_packing() -> LinearPacking:
    kernel = best_kernel()
    return LinearPacking(
        functools.partial(Bf16DotLinear, kernel=kernel),
        functools.partial(Bf16SiluMulLinear, kernel=kernel),
    )


def engine_model(folder, dtype: torch.dtype = torch.bfloat16, pack: bool = True) -> CausalLM:
    """The model as a CPU engine sets it up: linears packed, layer ops on."""
    model = load_hf_model(folder, dtype, "cpu", 128)[0]
    if pack:
        model.prepack_linears(bf16_packing())
    model.use_layer_ops(CpuLayerOps.build())
    return model


# (tables, tokens already in the pool, new tokens) per step, for two sequences: prompts in
# chunks, then decodes, with a step that mixes a chunk and a decode. Tables are scattered.
TABLES = [[7, 2, 9, 0, 5, 11], [3, 10, 1, 8, 6, 4]]
STEPS = [([0], [0], [9]), ([0, 1], [9, 0], [1, 6]), ([0, 1], [10, 6], [1, 5]),
         ([0, 1], [11, 11], [1, 1]), ([0, 1], [12, 12], [1, 1])]  # fmt: skip


def run_steps(model: CausalLM, direct: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each step's hidden states, and the pool's K/V at the end."""
    backend = make_attention_backend("cpu", CPU)
    kv = new_kv_cache(model.config, 12, BLOCK, torch.bfloat16)
    ids = [random_ids(24, seed=3), random_ids(24, seed=4)]
    saved, model.direct = model.direct, model.direct if direct else None
    outs = []
    try:
        for seqs, cached, new in STEPS:
            meta, positions = step_meta([TABLES[s] for s in seqs], cached, new, BLOCK)
            rows = zip(seqs, cached, new, strict=True)
            tokens = [t for s, c, n in rows for t in ids[s][c : c + n]]
            outs.append(model(torch.tensor(tokens), positions, meta, kv, backend.plan(meta)))
    finally:
        model.direct = saved
    return outs, torch.stack([*kv.k, *kv.v])


# Not on the direct path: the MoE families' expert blocks.
MODULES_ONLY = {"qwen3_moe", "qwen3_moe_step2", "mixtral"}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_direct_forward_equals_the_modules(tmp_path, variant):
    build_hf_model(variant).save_pretrained(tmp_path)
    model = engine_model(tmp_path)
    assert model.use_direct_forward() == (variant not in MODULES_ONLY)
    if model.direct is None:
        return
    modules, kv_modules = run_steps(model, direct=False)
    direct, kv_direct = run_steps(model, direct=True)
    for a, b in zip(modules, direct, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        assert torch.equal(a, b)
    assert torch.equal(kv_modules, kv_direct)
    assert kv_direct.float().abs().sum() > 0


def test_direct_forward_applies_only_where_it_runs_the_same_kernels(tmp_path):
    """None (the modules run) for float32, for linears the bf16 kernel does not run, after the
    layer ops change, for a layer without them, and for Gemma's own forward."""
    build_hf_model("llama_gqa_tied").save_pretrained(tmp_path / "llama")
    assert DirectForward.build(engine_model(tmp_path / "llama", torch.float32, pack=False)) is None
    assert DirectForward.build(engine_model(tmp_path / "llama", pack=False)) is None
    model = engine_model(tmp_path / "llama")
    assert model.use_direct_forward()
    model.use_layer_ops(CpuLayerOps.build())  # the path called the old ops: dropped
    assert model.direct is None
    model.layers[1].self_attn.layer_ops = None
    assert not model.use_direct_forward() and model.direct is None
    build_gemma("gemma2").save_pretrained(tmp_path / "gemma")
    gemma = engine_model(tmp_path / "gemma")
    assert not gemma.use_direct_forward() and DirectForward.build(gemma) is None


@pytest.mark.skipif(not NATIVE, reason="the engine packs bf16 linears on AVX512-BF16 only")
def test_engine_takes_the_direct_path_with_the_same_tokens(tiny_folder, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Paged attention", "A radix tree", "def add(a")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(str(tiny_folder), dtype="bfloat16", max_num_batched_tokens=8)
    model = llm.engine.runner.model
    assert model.direct is not None
    direct = llm.generate(prompts, params, use_tqdm=False)
    model.direct = None
    modules = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(direct, modules, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.skipif(not NATIVE, reason="DirectForward runs in the engine on AVX512-BF16 only")
def test_direct_forward_benchmark_smoke(tmp_path, capsys):
    from jobs.bench import direct_forward_ab

    out = tmp_path / "ab.json"
    direct_forward_ab.main(["--smoke", "--decode-steps", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert "| system |" in text and "decode steps at 4 running" in text
    assert out.exists()


def test_step_profile_buckets_the_direct_calls_by_their_line():
    """A sample inside a kernel called by DirectForward stops at the calling line: the step
    profile buckets it by that line's call, and a deeper attention frame by its own."""
    from jobs.bench.step_profile import DIRECT_SOURCE, bucket_of

    lines = DIRECT_SOURCE.read_text().splitlines()
    step = "decode_steps (jobs/bench/step_profile.py:90)"

    def frame_at(call: str) -> str:
        number = next(i for i, text in enumerate(lines, 1) if call in text)
        return f"__call__ (batchpage/model/direct_forward.py:{number})"

    assert bucket_of([step, frame_at("linear(qkv")], lines) == "linears"
    assert bucket_of([step, frame_at("ops.add_rms_norm(normed")], lines) == "norms"
    assert bucket_of([step, frame_at("ops.rope(")], lines) == "rope"
    kernel = "__call__ (batchpage/attention/cpu_backend.py:70)"
    assert bucket_of([step, frame_at("heads = attn("), kernel], lines) == "attention"
    assert bucket_of([step, frame_at("residual = self.embed_tokens")], lines) == "model, other"
