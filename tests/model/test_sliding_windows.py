"""Models with sliding windows shorter than their prompts, through the whole engine, against HF
transformers: every layer windowed (Mistral), windowed and full layers mixed (Qwen2), on the
torch backend and the CPU kernel, with prefix-cache hits on a shared prefix longer than the
window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, PretrainedConfig, Qwen2Config

from batchpage import LLM, SamplingParams
from batchpage.model.hf_loader import load_hf_model
from tests.engine.test_engine import assert_matches_hf
from tests.model.test_families import prefill_logits, random_ids
from tests.model_factory import hf_logits, save_hf_folder, tiny_tokenizer

WINDOW = 7  # smaller than the prompts, not a multiple of the block size (4)
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "mistral": (MistralConfig, dict(sliding_window=WINDOW)),
    # Qwen2: layer 0 full attention, layer 1 windowed (max_window_layers=1).
    "qwen2": (
        Qwen2Config,
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
}


def windowed_hf_model(name: str, vocab_size: int) -> torch.nn.Module:
    """A float32 transformers model with every parameter random (as model_factory's)."""
    config_cls, window = CONFIGS[name]
    config = config_cls(
        **SIZES, **window, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model


def prompts(vocab: int) -> list[list[int]]:
    """Prompts from 1 to 40 tokens, four of them after the same 22-token prefix (three windows
    long, so the cached blocks include some no later token's window reaches)."""
    rng = random.Random(3)
    shared = [rng.randrange(3, vocab) for _ in range(22)]
    alone = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 9, 17, 40)]
    return alone + [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 3, 6, 11)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tokenizer, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    hf = windowed_hf_model(request.param, len(tokenizer))
    folder = save_hf_folder(hf, tmp_path_factory.mktemp(request.param), tokenizer)
    return request.param, hf, folder


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_matches_hf_past_the_window(checkpoint, backend: str) -> None:
    name, hf, folder = checkpoint
    llm = LLM(
        model=str(folder), dtype="float32", block_size=4, kv_cache_memory=2**22,
        attention_backend=backend, max_num_batched_tokens=24,  # prompts split into chunks
    )  # fmt: skip
    assert llm.max_model_len == SIZES["max_position_embeddings"]  # no cap to the window
    windows = [layer.self_attn.sliding_window for layer in llm.engine.runner.model.layers]
    assert windows == ([WINDOW, WINDOW] if name == "mistral" else [None, WINDOW])
    llm.engine.check_integrity_each_step = True
    batch = prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert llm.stats["cached_prompt_tokens"] > 0  # the shared prefix came from the cache
    assert_matches_hf(hf, batch, outputs, 20, stop_at_eos=False)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_prefix_cache_reuse_gives_the_same_outputs(checkpoint) -> None:
    """The shared prefix computed once and lent to the others gives what computing it for each
    prompt gives, although each layer reads only its window of those blocks."""
    _, hf, folder = checkpoint
    batch = prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens, cached = {}, {}
    for caching in (True, False):
        llm = LLM(
            model=str(folder), dtype="float32", block_size=4, kv_cache_memory=2**22,
            attention_backend="torch", prefix_caching=caching,
        )  # fmt: skip
        outs = llm.generate(batch, params, use_tqdm=False)
        tokens[caching] = [o.outputs[0].token_ids for o in outs]
        cached[caching] = llm.stats["cached_prompt_tokens"]
    assert cached[True] >= 3 * 20 and cached[False] == 0
    assert tokens[True] == tokens[False]


def test_windowed_prefill_logits_match_hf(checkpoint) -> None:
    """Model level, no engine: one 45-token prompt's logits at every position, where HF's
    windowed mask hides most of the context from the late rows."""
    _, hf, folder = checkpoint
    ours = load_hf_model(folder, torch.float32, "cpu")[0]
    ids = random_ids(45, seed=4, vocab=hf.config.vocab_size)
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)
