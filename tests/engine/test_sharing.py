"""Copy-on-write at work: n samples forked from one prefill, swap preemption, and the static
allocator baseline, each against a run that shares nothing."""

from __future__ import annotations

import random

import pytest

from batchpage import LLM, SamplingParams
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer

PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, block 4, 2 KV heads, head_dim 16, float32


def make(tiny_folder: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 2**22)
    llm = LLM(model=tiny_folder, dtype="float32", block_size=4, max_model_len=96, **kw)
    llm.engine.check_integrity_each_step = True
    return llm


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(5, 30))] for _ in range(count)]


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_forked_samples_equal_independent_samples(tiny_folder: str) -> None:
    params = SamplingParams(n=4, temperature=1.0, top_k=20, seed=11, max_tokens=20, ignore_eos=True)
    ps = prompts(5, seed=1)
    forked = make(tiny_folder, prefix_caching=False)
    got = tokens(forked.generate(ps, params, use_tqdm=False))
    # The static allocator runs the 4 samples as separate sequences, each prefilling the prompt.
    separate = make(tiny_folder, kv_allocator="static", prefix_caching=False)
    want = tokens(separate.generate(ps, params, use_tqdm=False))
    assert got == want
    assert all(len({tuple(t) for t in samples}) > 1 for samples in got)  # samples differ
    assert forked.stats["prefill_tokens_computed"] * 4 == separate.stats["prefill_tokens_computed"]
    pool = forked.engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks


def test_fork_shares_blocks_until_written(tiny_folder: str) -> None:
    llm = make(tiny_folder, prefix_caching=False)
    ps = [list(range(3, 3 + 22))]  # 22 tokens: 5 full blocks and a partial one, shared by all
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=1, ignore_eos=True)
    llm.generate(ps, params, use_tqdm=False)
    # One copy of the prompt's 6 blocks, not 4: the samples stopped before any of them wrote.
    assert llm.stats["peak_kv_blocks_used"] == 6
    llm.generate(ps, params.replace(max_tokens=2), use_tqdm=False)
    # Writing its second token, each sample but the last holder copies the shared partial block.
    assert llm.stats["peak_kv_blocks_used"] == 6 + 3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_swap_preemption_gives_the_same_outputs(tiny_folder: str, prefix_caching: bool) -> None:
    ps = prompts(12, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = tokens(make(tiny_folder).generate(ps, params, use_tqdm=False))
    small = make(
        tiny_folder,
        kv_cache_memory=24 * PER_BLOCK,
        preemption_mode="swap",
        prefix_caching=prefix_caching,
    )
    small.engine.scheduler.growth = None  # admit on the prompt alone, so this pool preempts
    got = tokens(small.generate(ps, params, use_tqdm=False))
    assert got == want
    assert small.stats["swaps"] > 0 and small.stats["preemptions"] >= small.stats["swaps"]
    assert not small.engine.runner.swapped  # every swapped-out sequence came back


def test_static_allocator_reserves_max_model_len(tiny_folder: str) -> None:
    ps = prompts(8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    paged = make(tiny_folder, prefix_caching=False, kv_cache_memory=48 * PER_BLOCK)
    static = make(
        tiny_folder, kv_allocator="static", prefix_caching=False, kv_cache_memory=48 * PER_BLOCK
    )
    assert tokens(static.generate(ps, params, use_tqdm=False)) == tokens(
        paged.generate(ps, params, use_tqdm=False)
    )
    # 48 blocks hold two reservations of 24 blocks (96 tokens): at most two run at once.
    assert static.stats["peak_running"] == 2
    # Paged admits what the sequences' real lengths (prompt + 10, ignore_eos) fit: three times
    # as many, and none is preempted.
    assert paged.stats["peak_running"] >= 6
    assert paged.stats["preemptions"] == 0
    assert static.stats["kv_waste"] > 0.5 > 0.25 > paged.stats["kv_waste"]


def test_prompt_and_sample_logprobs_match_hf(tmp_path) -> None:
    import torch

    tok = tiny_tokenizer()
    hf = build_hf_model("llama_bias_untied", vocab_size=len(tok))
    tiny_folder = str(save_hf_folder(hf, tmp_path / "m", tok))
    # A 16-token budget splits the 40-token prompt into chunks; prefix caching stays on.
    llm = LLM(
        model=tiny_folder,
        dtype="float32",
        block_size=4,
        max_model_len=96,
        kv_cache_memory=2**22,
        max_num_batched_tokens=16,
    )
    ps = prompts(3, seed=6) + [[5] * 40]
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    llm.generate([ps[-1]], params.replace(prompt_logprobs=None), use_tqdm=False)  # warm cache
    outs = llm.generate(ps, params, use_tqdm=False)
    for p, out in zip(ps, outs, strict=True):
        ids = p + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for pos, entry in enumerate(out.prompt_logprobs[1:]):
            token = p[pos + 1]
            assert entry[token] == pytest.approx(ref[pos, token].item(), abs=1e-4)
            top = ref[pos].topk(2).indices.tolist()
            assert set(top) <= set(entry)
        for k, entry in enumerate(out.outputs[0].logprobs):
            pos = len(p) - 1 + k
            token = out.outputs[0].token_ids[k]
            assert entry[token] == pytest.approx(ref[pos, token].item(), abs=1e-4)
            assert set(ref[pos].topk(3).indices.tolist()) <= set(entry)
