"""The LoRA API in vLLM's shape: generate / chat / beam_search with lora_request, a bad adapter
failing only its own requests, and what is refused before anything runs."""

from __future__ import annotations

import random

import pytest
import torch

from batchpage import LLM, LoRARequest, SamplingParams
from batchpage.engine.config import EngineConfig
from batchpage.sampling_params import BeamSearchParams
from tests.engine.test_beam_search import hf_beams
from tests.lora.peft_adapters import make_adapter
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Qwen2 model, two PEFT adapters over it, and an engine with room for both."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("lora_api")
    base = build_hf_model("qwen2_bias_gqa", vocab_size=len(tok))
    save_hf_folder(base, root / "base", tok)
    peft = [make_adapter(base, root / f"a{i}", rank=4, seed=i) for i in range(2)]
    loras = [LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")) for i in range(2)]
    llm = LLM(str(root / "base"), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=4, kv_cache_memory=2**22, block_size=4)  # fmt: skip
    llm.engine.check_integrity_each_step = True
    return llm, base, peft, loras, root


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@torch.no_grad()
def hf_tokens(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_a_bad_adapter_fails_its_own_requests_only(tiny, tmp_path):
    llm, base, peft, loras, _ = tiny
    broken = LoRARequest("broken", 7, str(tmp_path / "missing"))
    big = tmp_path / "big"
    make_adapter(base, big, rank=8)  # above max_lora_rank=4
    too_big = LoRARequest("big", 8, str(big))
    prompt = [5, 9, 13, 17, 21]
    outs = llm.generate(
        [prompt] * 4, GREEDY, lora_request=[loras[0], broken, None, too_big], use_tqdm=False
    )
    assert "LoRA adapter 'broken'" in outs[1].error and "no such folder" in outs[1].error
    assert "rank 8 exceeds max_lora_rank=4" in outs[3].error
    assert not outs[1].outputs and not outs[3].outputs
    assert outs[0].outputs[0].token_ids == hf_tokens(peft[0], prompt, 6)
    assert outs[2].outputs[0].token_ids == hf_tokens(base, prompt, 6)


def test_one_adapter_for_every_prompt_and_chat(tiny):
    llm, _, peft, loras, _ = tiny
    prompts = [[7, 8, 9], [30, 31, 32, 33]]
    outs = llm.generate(prompts, GREEDY, lora_request=loras[1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens(peft[1], p, 6) for p in prompts]
    chat = [{"role": "user", "content": "Hello world"}]
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    got = llm.chat(chat, GREEDY, lora_request=loras[1], use_tqdm=False)[0]
    assert got.prompt_token_ids == ids
    assert got.outputs[0].token_ids == hf_tokens(peft[1], ids, 6)


def test_beam_search_runs_the_adapter(tiny):
    llm, _, peft, loras, _ = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    outs = llm.beam_search(prompts, params, lora_request=loras[0])
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_beams(peft[0], prompt, 3, 3, 8, 1.0, False, eos=None)
        assert [b.tokens[len(prompt) :] for b in out.sequences] == want


def test_what_is_refused_before_anything_runs(tiny, tmp_path):
    llm, _, _, loras, root = tiny
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([[5], [6]], GREEDY, lora_request=[loras[0]], use_tqdm=False)
    plain = LLM(str(root / "base"), dtype="float32", kv_cache_memory=2**22)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5]], GREEDY, lora_request=loras[0], use_tqdm=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(enable_lora=True, batch_invariant=True)
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(enable_lora=True, max_loras=0)


def test_embeddings_run_the_adapter(tiny):
    """task=embed on the causal LM, rows of an adapter and of the base model in one call: each
    the final-norm states of its own HF model (PEFT's for the adapter), mean-pooled."""
    _, base, peft, loras, root = tiny
    llm = LLM(str(root / "base"), dtype="float32", task="embed", pooling_type="mean",
              enable_lora=True, max_loras=1, max_lora_rank=4, kv_cache_memory=2**22)  # fmt: skip
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
    outs = llm.embed(prompts, lora_request=[loras[0], None, loras[1]], use_tqdm=False)
    for out, model in zip(outs, [peft[0], base, peft[1]], strict=True):
        with torch.no_grad():
            hf = model(torch.tensor([out.prompt_token_ids]), output_hidden_states=True)
        want = torch.nn.functional.normalize(hf.hidden_states[-1][0].mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=0)


def test_structured_outputs_hold_under_an_adapter(tiny, tmp_path):
    """A choice constraint on rows of an adapter gives what the same constraint gives on the
    adapter merged into the model by PEFT (a plain model folder, no LoRA)."""
    from batchpage import StructuredOutputsParams
    from tests.lora.peft_adapters import merged

    llm, _, peft, loras, _ = tiny
    save_hf_folder(merged(peft[0]), tmp_path / "merged", llm.tokenizer.hf)
    plain = LLM(str(tmp_path / "merged"), dtype="float32", kv_cache_memory=2**22)
    choices = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    prompts = [[5, 9, 13], [40, 41, 42, 43], [7], [100, 3, 250]]
    got = llm.generate(prompts, params, lora_request=loras[0], use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(o.outputs[0].text in choices for o in got)


def test_forked_samples_keep_their_adapter(tiny):
    """n > 1 forks samples from the prompt's sequence after its prefill: each sample runs the
    adapter (greedy: every sample is PEFT's greedy continuation), and the slots' integrity holds
    while forks come and go."""
    llm, _, peft, loras, _ = tiny
    prompts = [[11, 12, 13, 14, 15], [60, 61]]
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=[loras[1], loras[0]], use_tqdm=False)
    for out, prompt, model in zip(outs, prompts, [peft[1], peft[0]], strict=True):
        want = hf_tokens(model, prompt, 6)
        assert [c.token_ids for c in out.outputs] == [want] * 3


def test_prompt_logprobs_are_the_adapters(tiny):
    """prompt_logprobs of a row run under an adapter: PEFT's log-softmax at every prompt
    position."""
    llm, _, peft, loras, _ = tiny
    prompt = [3, 17, 29, 41, 53, 67, 79, 83]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, lora_request=loras[0], use_tqdm=False)[0]
    with torch.no_grad():
        logp = torch.log_softmax(peft[0](torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i][prompt[i]]
        assert got == pytest.approx(float(logp[i - 1, prompt[i]]), abs=2e-4)
