"""The whole engine (scheduler, paged KV, continuous batching) against HF transformers.

HF runs one request at a time with `generate`; batchpage runs all of them as one batch of mixed
lengths. A greedy divergence is accepted only where the reference's top-2 logits nearly tie.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.engine.admission import GrowthEstimate
from tests.model_factory import (
    MODEL_LEVEL_ONLY,
    VARIANTS,
    build_hf_model,
    save_hf_folder,
    tiny_tokenizer,
)

TIE_GAP = 1e-2


def hf_greedy(model, prompt: list[int], max_new: int, stop_at_eos: bool) -> tuple[list[int], list]:
    """HF greedy continuation and its per-step logits."""
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0].float() for lg in out.logits]


def compare(ours: list[int], ref: list[int], ref_logits: list) -> str:
    """'same', 'tie' (diverged where the reference's top-2 nearly tie) or 'diverged'."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            return "tie" if (top2[0] - top2[1]).item() < TIE_GAP else "diverged"
    return "same" if len(ours) == len(ref) else "diverged"


def assert_matches_hf(hf_model, prompts, outputs, max_new, stop_at_eos) -> int:
    ties = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, logits = hf_greedy(hf_model, prompt, max_new, stop_at_eos)
        verdict = compare(out.outputs[0].token_ids, ref, logits)
        assert verdict != "diverged", (
            f"prompt {prompt[:8]}...: ours {out.outputs[0].token_ids} != {ref}"
        )
        ties += verdict == "tie"
    print(f"{ties} of {len(prompts)} sequences diverged at a near-tie (top-2 gap < {TIE_GAP})")
    return ties


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - set(MODEL_LEVEL_ONLY)))
def test_tiny_models_match_hf(variant: str, tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model(variant, vocab_size=len(tokenizer))
    folder = save_hf_folder(hf, tmp_path / variant, tokenizer)
    llm = LLM(model=str(folder), dtype="float32", block_size=4, kv_cache_memory=2**22)
    llm.engine.check_integrity_each_step = True
    prompts = random_prompts(16, len(tokenizer), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
    assert_matches_hf(hf, prompts, outputs, 32, stop_at_eos=False)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_preemption_gives_the_same_outputs(tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    prompts = random_prompts(12, len(tokenizer), seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = LLM(model=folder, dtype="float32", block_size=4, kv_cache_memory=2**24, max_model_len=96)
    # 24 blocks of 4 tokens: exactly one max_model_len sequence; 12 sequences must take turns.
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, 4 tokens, 2 KV heads, dim 16, fp32
    small = LLM(
        model=folder,
        dtype="float32",
        block_size=4,
        kv_cache_memory=24 * per_block,
        max_model_len=96,
    )
    small.engine.check_integrity_each_step = True
    assert small.engine.kv_manager.num_blocks == 24
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    # Admitting on the prompt alone makes this pool preempt; the default admission overcommits
    # certain growth (ignore_eos) by at most 2x and preempts rarely; reserving it in full
    # (certain_floor=1.0) never preempts here. The outputs are the same every time.
    small.engine.scheduler.growth = None
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    greedy = small.stats["preemptions"]
    assert greedy > 0
    assert got == want
    assert small.engine.kv_manager.num_free_blocks == 24
    small.engine.scheduler.growth = GrowthEstimate()
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.stats["preemptions"] <= min(greedy - 1, len(prompts) // 4)
    assert got == want
    small.engine.scheduler.growth = GrowthEstimate(certain_floor=1.0)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.stats["preemptions"] == 0
    assert got == want


def test_pool_too_small_is_a_clear_error(tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        LLM(model=folder, dtype="float32", kv_cache_memory=4096, max_model_len=256)


def test_bad_requests_do_not_lose_the_others(tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    llm = LLM(model=folder, dtype="float32", max_model_len=64, kv_cache_memory=2**22)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = ["Hello world", "", [5] * 80, [10**6], "The quick brown fox"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, False, False, True]
    assert "empty" in outs[1].error
    assert "max_model_len" in outs[2].error
    assert "token ids must be in" in outs[3].error
    assert all(len(o.outputs[0].token_ids) == 5 for o in (outs[0], outs[4]))
    alone = llm.generate(["The quick brown fox"], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[4].outputs[0].token_ids
    # vLLM's TextPrompt and TokensPrompt dicts are the same prompts; any other dict is an error.
    ids = outs[4].prompt_token_ids
    as_dicts = [{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}, {"text": "x"}]
    dict_outs = llm.generate(as_dicts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dict_outs[:2]] == [alone[0].outputs[0].token_ids] * 2
    assert dict_outs[2].error is not None and "prompt_token_ids" in dict_outs[2].error
    # A bool is an int to Python, never a token id to a user.
    bools = llm.generate([[True, False], {"prompt_token_ids": [5, True]}], params, use_tqdm=False)
    assert all(o.error == "prompt token ids must be ints, got a bool" for o in bools), bools
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(TypeError, match="unknown LLM argument"):
        LLM(model=folder, blocksize=16)


def test_seeded_sampling_does_not_depend_on_the_batch(tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model("qwen2_bias_gqa", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=2**22, max_model_len=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts(6, len(tokenizer), seed=3)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts[::-1], [other] * 5 + [seeded], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    stats = llm.stats
    for key in (
        "elapsed_s",
        "prompt_tokens",
        "generated_tokens",
        "output_tokens_per_s",
        "prefill_tokens_computed",
        "preemptions",
        "peak_running",
        "kv_blocks_total",
        "kv_utilization",
        "kv_waste",
        "ttft_s",
        "steps",
    ):
        assert key in stats
    assert stats["generated_tokens"] == 5 * 20 + 12
    assert 0.0 < stats["kv_utilization"] <= 1.0


def test_limits_of_the_engine_are_row_errors(tmp_path: Path, tokenizer) -> None:
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    # 8 blocks of 16 tokens (8 KiB each): one max_model_len sequence fits, four beams do not.
    llm = LLM(
        model=folder, dtype="float32", max_model_len=64, max_num_seqs=4, kv_cache_memory=2**16
    )
    assert llm.engine.kv_manager.num_blocks == 8
    outs = llm.generate(
        ["Hello", "Hello", "Hello", "Hello"],
        [
            SamplingParams(n=8, temperature=1.0),
            SamplingParams(logit_bias={10**6: 1.0}),
            SamplingParams(use_beam_search=True, beam_width=4, max_tokens=60, temperature=0),
            SamplingParams(max_tokens=3, temperature=0),
        ],
        use_tqdm=False,
    )
    assert "max_num_seqs" in outs[0].error
    assert "logit_bias" in outs[1].error
    assert "KV blocks" in outs[2].error
    assert outs[3].error is None and len(outs[3].outputs[0].token_ids) == 3


def test_a_decode_step_runs_no_python_per_sequence(tmp_path: Path, tokenizer, monkeypatch) -> None:
    """The stop checks of plain greedy rows are batch comparisons: a sequence's checker runs on
    its first token and its last (the one that ends it), not on every token; the step's inputs
    read no sequence's token list on a decode-only step. Outputs equal a run that checks every
    token (HF's, in test_tiny_models_match_hf)."""
    from batchpage.engine.stop_checker import StopChecker

    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = str(save_hf_folder(hf, tmp_path / "m", tokenizer))
    prompts = random_prompts(6, len(tokenizer), seed=5)
    lengths = [3, 9, 17, 17, 30, 31]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm = LLM(model=folder, dtype="float32", block_size=4, kv_cache_memory=2**24)
    llm.engine.check_integrity_each_step = True
    calls = {"catch_up": 0, "append": 0}
    for name in calls:
        original = getattr(StopChecker, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(StopChecker, name, counted)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert calls["catch_up"] == 2 * len(prompts)  # each sequence's first token and last
    assert calls["append"] == calls["catch_up"]  # catch_up decides through append
    want = [
        hf_greedy(hf, p, n, stop_at_eos=False)[0] for p, n in zip(prompts, lengths, strict=True)
    ]
    for out, ref in zip(outs, want, strict=True):
        assert out.outputs[0].token_ids == ref
