"""LlamaForCausalLM against HF transformers on the same random weights, through the paged cache."""

from __future__ import annotations

import math

import pytest
import torch

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model.config import ModelConfig, UnsupportedModelError
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.llama import LlamaForCausalLM, rope_inv_freq
from tests.model_factory import (
    VARIANTS,
    build_hf_model,
    hf_logits,
    new_kv_cache,
    prefill_meta,
    save_hf_folder,
    step_meta,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """variant -> (HF model, our model loaded from its saved folder)."""
    out = {}
    for variant in VARIANTS:
        hf = build_hf_model(variant)
        folder = save_hf_folder(hf, tmp_path_factory.mktemp(variant))
        out[variant] = (hf, load_hf_model(folder, torch.float32, "cpu")[0])
    return out


@torch.no_grad()
def prefill_logits(model: LlamaForCausalLM, ids: list[int], block_size: int = 8) -> torch.Tensor:
    kv = new_kv_cache(model.config, -(-len(ids) // block_size), block_size)
    meta = prefill_meta(len(ids), block_size)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv, TorchPagedAttention())
    return model.compute_logits(hidden)


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(checkpoints, variant):
    hf, ours = checkpoints[variant]
    ids = random_ids(45, seed=1)  # > original_max_position_embeddings of the llama3 variant
    ref = hf_logits(hf, ids)
    got = prefill_logits(ours, ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "qwen2_bias_gqa", "llama_hd80_mqa"])
def test_chunked_prefill_and_decode_in_a_shared_pool(checkpoints, variant):
    """Two sequences in scattered blocks, run as prefill chunks, then mixed steps, then decodes:
    every row's logits equal HF's logits for that position of the full sequence."""
    hf, ours = checkpoints[variant]
    block_size = 4
    seqs = [random_ids(23, seed=2), random_ids(17, seed=3)]
    refs = [hf_logits(hf, s) for s in seqs]
    tables = [[9, 2, 14, 5, 0, 11], [7, 3, 12, 1, 8]]  # shuffled, disjoint
    kv = new_kv_cache(ours.config, 16, block_size)
    # (new tokens per sequence) per step: chunked prefills, a mixed step, then decode steps.
    schedule = [(10, 6), (8, 5), (1, 3), (1, 1), (1, 1), (1, 1), (1, 0)]
    done = [0, 0]
    for new in schedule:
        active = [b for b in range(2) if new[b]]
        meta, positions = step_meta(
            [tables[b] for b in active], [done[b] for b in active], [new[b] for b in active], 4
        )
        ids = torch.tensor([t for b in active for t in seqs[b][done[b] : done[b] + new[b]]])
        with torch.no_grad():
            logits = ours.compute_logits(ours(ids, positions, meta, kv, TorchPagedAttention()))
        row = 0
        for b in active:
            want = refs[b][done[b] : done[b] + new[b]]
            torch.testing.assert_close(logits[row : row + new[b]], want, atol=ATOL, rtol=0)
            row += new[b]
            done[b] += new[b]
    assert done == [23, 17]


def test_bfloat16_model_tracks_float32(tmp_path):
    hf = build_hf_model("llama_gqa_tied")
    folder = save_hf_folder(hf, tmp_path)
    model, _ = load_hf_model(folder, torch.bfloat16, "cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.cos.dtype == torch.float32  # tables stay float32 in a bf16 model
    ids = random_ids(20, seed=4)
    got, ref = prefill_logits(model, ids), hf_logits(hf, ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_load_weights_rejects_missing_and_misshapen(tmp_path):
    hf = build_hf_model("llama_bias_untied")
    state = dict(hf.state_dict())
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    no_head = [(k, v) for k, v in state.items() if k != "lm_head.weight"]
    with pytest.raises(ValueError, match="missing weights.*lm_head"):
        LlamaForCausalLM(cfg).load_weights(no_head)
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LlamaForCausalLM(cfg).load_weights(bad.items())
    with pytest.raises(ValueError, match="unexpected weight"):
        LlamaForCausalLM(cfg).load_weights([*state.items(), ("model.extra.weight", torch.ones(1))])


def test_hf_config_transformers4_layout():
    """Older config.json: rope_theta/rope_scaling at top level, no head_dim, eos as a list."""
    cfg = ModelConfig.from_hf_config(
        {
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 131072,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "torch_dtype": "bfloat16",
        }
    )
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.torch_dtype == "bfloat16" and not cfg.tie_word_embeddings
    assert cfg.max_model_len == 131072


def test_hf_config_qwen2_and_mistral_flags():
    base = dict(
        vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    qwen = ModelConfig.from_hf_config(dict(base, model_type="qwen2", sliding_window=4096))
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_hf_config(
        dict(base, model_type="mistral", sliding_window=512, max_position_embeddings=4096)
    )
    assert mistral.sliding_window == 512 and mistral.max_model_len == 512
    assert not mistral.attention_bias


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ],
)
def test_hf_config_unsupported(patch, match):
    cfg = dict(
        model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=4,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_config({**cfg, **patch})


def test_llama3_inv_freq_bands():
    """High frequencies are kept, low ones divided by factor, the middle band blended."""
    cfg = ModelConfig.from_hf_config(
        dict(
            model_type="llama", vocab_size=10, hidden_size=512, intermediate_size=8,
            num_hidden_layers=1, num_attention_heads=4, rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        )
    )  # fmt: skip
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    scaled = rope_inv_freq(cfg)
    wavelen = 2 * math.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    mid = ~high & ~low
    assert mid.any()
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()
