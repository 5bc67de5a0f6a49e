"""batch_invariant=True as a property: a target prompt's greedy tokens and every logprob (and,
with a per-request seed, its sampled tokens) are the same bits run alone and run among 1 to 255
other prompts, in another order, with its prefill chunked differently, behind a warm prefix
cache, preempted (recompute and swap). Hypothesis draws the prompts and the variation; the
reference is the target alone on an engine with room for everything.

The models: a random Llama and a Mistral with a sliding window of 21, both of head_dim 64 (the
attention kernels' vector paths; bf16 on a CPU with AVX512-BF16 takes their vdpbf16ps paths),
with a vocabulary of 320."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpage import LLM, SamplingParams
from batchpage.cpu_info import cpu_flags
from tests.model_factory import build_hf_model, save_hf_folder

BLOCK = 16
VOCAB = 320
DTYPES = [
    "float32",
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            "avx512_bf16" not in cpu_flags(), reason="batch-invariant bf16 needs AVX512-BF16"
        ),
    ),
]
MAX_TOKENS = 12
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


HD64 = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
MODELS = {  # name -> (variant, overrides)
    "llama": ("llama_gqa_tied", HD64),
    # A window of 21: rows' windows start at odd and even positions, mid-chunk.
    "windowed": ("mistral_mha", {**HD64, "head_dim": 64, "sliding_window": 21}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer) -> dict[str, Path]:
    made = {}
    for name, (variant, overrides) in MODELS.items():
        hf = build_hf_model(variant, len(tokenizer), **overrides)
        made[name] = save_hf_folder(hf, tmp_path_factory.mktemp(name), tokenizer)
    return made


@pytest.fixture(scope="module")
def folder(folders) -> Path:
    return folders["llama"]


# A GPU's batch-invariant kernels (Triton matmul, norms and extend attention), run here under
# Triton's interpreter: float32 only (it has no bfloat16 arithmetic) and few, small examples.
# The interpreter copies every tensor a kernel takes, the KV pool included, at each launch:
# a pool of 128 blocks.
TRITON = {"attention_backend": "triton", "linear_backend": "triton", "kv_cache_memory": 2**21}
TRITON_SETTINGS = settings(SETTINGS, max_examples=2)


def engine(folder: Path, dtype: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 2**24)
    kw.setdefault("max_model_len", 256)
    llm = LLM(str(folder), dtype=dtype, batch_invariant=True, block_size=BLOCK, **kw)
    llm.engine.check_integrity_each_step = True
    return llm


@dataclass(frozen=True)
class Case:
    target: list[int]
    others: list[list[int]]
    at: int  # the target's place among the others
    variation: str
    budget: int  # max_num_batched_tokens
    seed: int | None  # sampled with this seed, else greedy
    max_tokens: int = MAX_TOKENS

    def params(self) -> SamplingParams:
        if self.seed is None:
            return SamplingParams(temperature=0, max_tokens=self.max_tokens, logprobs=3,
                                  ignore_eos=True)  # fmt: skip
        return SamplingParams(temperature=1.0, top_k=50, seed=self.seed,
                              max_tokens=self.max_tokens, logprobs=3, ignore_eos=True)  # fmt: skip


@st.composite
def cases(
    draw: st.DrawFn,
    counts: tuple[int, ...] = (1, 3, 12, 40, 255),
    longest: int = 70,
    max_tokens: int = MAX_TOKENS,
) -> Case:
    """`counts`: how many other prompts there may be; `longest`: the longest target prompt
    (the others' own tokens are at most 50 tokens beyond what they share with it)."""
    tokens = st.integers(3, VOCAB - 1)
    target = draw(st.lists(tokens, min_size=1, max_size=longest))
    count = draw(st.sampled_from(counts))
    rng = random.Random(draw(st.integers(0, 2**16)))
    others = []
    for _ in range(count):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, min(50, longest)))]
        shared = target[: rng.randint(0, len(target))] if rng.random() < 0.3 else []
        others.append(shared + own)
    variation = draw(st.sampled_from(["batch", "reordered", "chunked", "warm_prefix",
                                      "recompute", "swap"]))  # fmt: skip
    budget = draw(st.sampled_from([7, 16, 33, 512])) if variation == "chunked" else 512
    seed = draw(st.one_of(st.none(), st.integers(0, 1000)))
    at = draw(st.integers(0, count))
    return Case(target, others, at, variation, budget, seed, max_tokens)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def result(out) -> tuple:
    """Tokens and every logprob the output holds, exactly (floats compared as bits)."""
    c = out.outputs[0]
    return (c.token_ids, [sorted(d.items()) for d in c.logprobs], c.cumulative_logprob)


def variant_run(folder: Path, dtype: str, case: Case, **kw) -> tuple:
    """The target's result under the case's variation (`kw`: the engines' other options)."""
    params = case.params()
    batch = case.others[: case.at] + [case.target] + case.others[case.at :]
    at = case.at
    if case.variation == "reordered":
        order = list(range(len(batch)))
        random.Random(len(batch)).shuffle(order)
        batch, at = [batch[i] for i in order], order.index(case.at)
    if case.variation in ("recompute", "swap"):
        # A pool that holds the longest request and a little more: the batch must preempt.
        need = max(-(-(len(p) + case.max_tokens) // BLOCK) for p in batch) + 2
        per_block = 2 * 2 * 1 * 64 * BLOCK * torch.finfo(getattr(torch, dtype)).bits // 8
        small = {"kv_cache_memory": need * per_block, "max_model_len": (need - 2) * BLOCK,
                 "preemption_mode": case.variation}  # fmt: skip
        llm = engine(folder, dtype, **{**kw, **small})
        llm.engine.scheduler.growth = None  # admit on the prompt alone, so the pool preempts
        got = run(llm, batch, params)[at]
        return result(got), llm.stats["preemptions"]
    llm = engine(folder, dtype, max_num_batched_tokens=case.budget, **kw)
    if case.variation == "warm_prefix":
        run(llm, [case.target[: max(1, len(case.target) - 1)], *case.others[:2]], params)
    return result(run(llm, batch, params)[at]), 0


@pytest.fixture(scope="module")
def alone_engines() -> dict[tuple[str, str], LLM]:
    return {}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(case=cases())
def test_a_rows_results_do_not_depend_on_its_batch(
    folders, alone_engines, model, dtype, case
) -> None:
    folder = folders[model]
    if (model, dtype) not in alone_engines:
        alone_engines[model, dtype] = engine(folder, dtype, prefix_caching=False)
    alone = result(run(alone_engines[model, dtype], [case.target], case.params())[0])
    got, _ = variant_run(folder, dtype, case)
    assert got == alone, case.variation


@pytest.mark.parametrize("model", list(MODELS))
@TRITON_SETTINGS
@given(case=cases(counts=(1, 3, 6), longest=40, max_tokens=5))
def test_on_the_triton_kernels_too(folders, alone_engines, model, case) -> None:
    """The same property on a GPU's kernels: the Triton matmul, one-row norms and every row on
    the extend attention kernel (what batch_invariant binds on CUDA)."""
    folder = folders[model]
    if (model, "triton") not in alone_engines:
        alone_engines[model, "triton"] = engine(folder, "float32", prefix_caching=False, **TRITON)
    alone = result(run(alone_engines[model, "triton"], [case.target], case.params())[0])
    got, _ = variant_run(folder, "float32", case, **TRITON)
    assert got == alone, case.variation


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_preempting_pool_preempts(folder, mode) -> None:
    """The variation above does what it says: its pool preempts the target's batch."""
    case = Case([5] * 40, [[7] * 45] * 8, 3, mode, 512, None)
    _, preemptions = variant_run(folder, "float32", case)
    assert preemptions > 0


def test_without_it_a_row_can_differ(folder) -> None:
    """The counterexample the mode exists for, on the same model: with batch_invariant=False
    the target's logprobs among other rows differ from alone in some bits."""
    target = list(range(10, 60))
    others = [[rng % 300 + 3 for rng in range(i, i + 30)] for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, max_model_len=256,
              kv_cache_memory=2**24, linear_backend="torch")  # fmt: skip
    alone = result(run(llm, [target], params)[0])
    among = result(run(llm, [*others[:20], target, *others[20:]], params)[20])
    assert alone != among


def test_the_torch_attention_backend_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="not attention_backend='torch'"):
        LLM("/nonexistent", batch_invariant=True, attention_backend="torch")


def test_the_engine_binds_the_invariant_kernels(folder) -> None:
    llm = engine(folder, "float32")
    run(llm, [[5, 6, 7]], SamplingParams(max_tokens=1))
    assert llm.stats["linear_methods"] == {"*": "cpu_f32"}
    assert llm.engine.runner.attention.batch_invariant


def test_the_triton_engine_binds_the_triton_kernels(folder) -> None:
    """And its tokens are the C++ kernels' engine's (logprobs within float32 rounding)."""
    llm = engine(folder, "float32", **TRITON)
    target = [(3 * i) % 300 + 3 for i in range(30)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    got = run(llm, [target], params)[0].outputs[0]
    assert llm.stats["linear_methods"] == {"*": "triton"}
    assert llm.engine.runner.attention.batch_invariant
    assert llm.engine.model.bound.layer.name == "triton"
    cpu = run(engine(folder, "float32"), [target], params)[0].outputs[0]
    assert got.token_ids == cpu.token_ids
    for mine, theirs in zip(got.logprobs, cpu.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [7, 9, 33])
def test_a_windowed_prompt_chunked_anywhere_is_computed_as_in_one_piece(
    folders, dtype, budget
) -> None:
    """A window's first chunk of keys starts wherever the chunk's first row's window does (odd
    or even): a row's sums must not depend on it (bf16: keys pair at even positions)."""
    target = [(7 * i) % 300 + 3 for i in range(75)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    whole = engine(folders["windowed"], dtype, prefix_caching=False)
    chunked = engine(folders["windowed"], dtype, prefix_caching=False,
                     max_num_batched_tokens=budget)  # fmt: skip
    assert result(run(chunked, [target], params)[0]) == result(run(whole, [target], params)[0])


def test_two_ranks_give_the_same_bits_in_any_batch(folder) -> None:
    """Tensor parallelism changes the order partial sums add in (TP=2 is not TP=1's bits), but
    a TP=2 engine's row is the same bits alone, among other rows and behind a cached prefix."""
    llm = engine(folder, "float32", tensor_parallel_size=2)
    target = [(5 * i) % 300 + 3 for i in range(40)]
    others = [[(i * j) % 300 + 3 for j in range(1, 25 + i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    alone = result(run(llm, [target], params)[0])  # its prompt cached from here on
    assert result(run(llm, [*others[:5], target, *others[5:]], params)[5]) == alone
