"""Many adapters in one batch, against HF transformers + PEFT (the adapters made by peft itself).

Each request's greedy tokens must be what the PEFT model of its adapter (or the base model)
picks at every position given the same prefix, and every logprob must match PEFT's, unmerged
and merged, whatever else shares the step: four adapters and the base model mixed, fewer slots
than adapters (adapters evicted and loaded again), a warm prefix cache with the same prompts
under other adapters, and preemption by recompute and by swap.
"""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, LoRARequest, SamplingParams
from tests.gemma_factory import build_gemma
from tests.lora.peft_adapters import make_adapter, merged
from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer

MAX_NEW = 8


def build(family: str, vocab: int):
    if family == "gemma2":
        return build_gemma("gemma2", vocab_size=vocab)
    return build_hf_model(family, vocab_size=vocab)


@pytest.fixture(scope="module", params=["llama_gqa_tied", "qwen3_tied", "gemma2"])
def setup(request, tmp_path_factory):
    """A base model folder, four PEFT adapters over it (ranks 2-8, one on a subset of modules,
    one rsLoRA) and the HF models to check against: (folder, base, [(request, peft, merged)])."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp(request.param)
    base = build(request.param, len(tok))
    save_hf_folder(base, root / "base", tok)
    configs = [
        dict(rank=4, alpha=16),
        dict(rank=8, alpha=8, use_rslora=True),
        dict(rank=2, alpha=4, targets=["q_proj", "v_proj", "down_proj"]),
        dict(rank=6, alpha=12, targets=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    ]
    adapters = []
    for i, config in enumerate(configs):
        folder = root / f"adapter{i}"
        peft = make_adapter(base, folder, seed=i, **config)
        adapters.append((LoRARequest(f"adapter{i}", i + 1, str(folder)), peft, merged(peft)))
    return root / "base", base, adapters


def prompts_and_adapters(adapters, vocab: int):
    """16 requests: 4 prompts, two sharing a long prefix, each under every adapter and the
    base model's, interleaved (so every step mixes them)."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (20,), generator=gen).tolist()
    prompts = [
        shared + torch.randint(3, vocab, (5,), generator=gen).tolist(),
        shared + torch.randint(3, vocab, (3,), generator=gen).tolist(),
        torch.randint(3, vocab, (9,), generator=gen).tolist(),
        torch.randint(3, vocab, (2,), generator=gen).tolist(),
    ]
    loras = [None] + [a[0] for a in adapters]
    pairs = [(p, loras[(i + j) % len(loras)]) for i, p in enumerate(prompts) for j in range(4)]
    return [p for p, _ in pairs], [lora for _, lora in pairs]


@torch.no_grad()
def check_against_hf(outputs, prompts, loras, base, adapters) -> None:
    models = {None: (base, base)} | {a[0].lora_int_id: (a[1], a[2]) for a in adapters}
    for out, prompt, lora in zip(outputs, prompts, loras, strict=True):
        assert out.error is None, out.error
        completion = out.outputs[0]
        tokens = completion.token_ids
        assert len(tokens) == MAX_NEW
        unmerged, merged_model = models[None if lora is None else lora.lora_int_id]
        ids = torch.tensor([prompt + tokens])
        for model, atol in ((unmerged, 2e-4), (merged_model, 1e-3)):
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
            assert logp.argmax(-1).tolist() == tokens, (lora, prompt)
            ours = torch.tensor([lp[t] for lp, t in zip(completion.logprobs, tokens, strict=True)])
            want = logp[torch.arange(MAX_NEW), torch.tensor(tokens)]
            torch.testing.assert_close(ours, want, rtol=0, atol=atol)


def run(folder, prompts, loras, **options):
    """An engine with adapters of rank <= 8 on 4-token blocks, checked after every step, and
    greedy params with the chosen token's logprob."""
    llm = LLM(
        str(folder), dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4,
        **options,
    )  # fmt: skip
    llm.engine.check_integrity_each_step = True
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    return llm, params


def test_a_mixed_batch_matches_peft_with_fewer_slots_than_adapters(setup):
    folder, base, adapters = setup
    prompts, loras = prompts_and_adapters(adapters, base.config.vocab_size)
    llm, params = run(folder, prompts, loras, max_loras=2, kv_cache_memory=2**22)
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    check_against_hf(outputs, prompts, loras, base, adapters)
    # The same prompts again, in another order, behind a warm cache: only rows of the same
    # adapter may hit each other's blocks, and results do not change.
    order = list(range(len(prompts)))[::-1]
    again = llm.generate(
        [prompts[i] for i in order], params, lora_request=[loras[i] for i in order],
        use_tqdm=False,
    )  # fmt: skip
    assert llm.stats["cached_prompt_tokens"] > 0
    check_against_hf(again, [prompts[i] for i in order], [loras[i] for i in order], base, adapters)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_rows_keep_their_adapter(setup, preemption_mode):
    folder, base, adapters = setup
    prompts, loras = prompts_and_adapters(adapters, base.config.vocab_size)
    # A pool that holds the longest request and a little more: the batch must preempt.
    cfg = base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4 * 4
    need = max(-(-(len(p) + MAX_NEW) // 4) for p in prompts) + 2
    llm, params = run(
        folder, prompts, loras, max_loras=3, kv_cache_memory=need * per_block,
        max_model_len=(need - 2) * 4, preemption_mode=preemption_mode,
    )  # fmt: skip
    llm.engine.scheduler.growth = None  # admit on the prompt alone, so the pool preempts
    outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert llm.stats["preemptions"] > 0
    check_against_hf(outputs, prompts, loras, base, adapters)
