"""Gemma 2 and Gemma 3 (text) against HF transformers on the same random weights: logits and greedy
tokens through the paged cache, past the 8-token sliding window; from the HF folder, the
multimodal Gemma 3 folder and llama.cpp-style GGUF files; and their configs against
transformers' own reading of them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import Gemma3Config

from batchpage import LLM, SamplingParams
from batchpage.attention.cpu_backend import CpuPagedAttention
from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.model import UnsupportedModelError
from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.families import build_model
from batchpage.model.gemma_config import gemma_gguf_config
from batchpage.model.gguf_loader import load_gguf_model
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model
from tests.gemma_factory import (
    GEMMA_VARIANTS,
    WINDOW,
    build_gemma,
    build_gemma3_multimodal,
    write_gemma_gguf,
)
from tests.model_factory import (
    hf_greedy,
    hf_logits,
    new_kv_cache,
    paged_greedy,
    step_meta,
    tiny_tokenizer,
)

ATOL = 1e-4
MAX_POSITIONS = 128


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """variant -> (HF model, our model loaded from its saved folder)."""
    out = {}
    for variant in GEMMA_VARIANTS:
        hf = build_gemma(variant)
        folder = tmp_path_factory.mktemp(variant)
        hf.save_pretrained(folder)
        out[variant] = (hf, load_hf_model(folder, torch.float32, "cpu", MAX_POSITIONS)[0])
    return out


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def prefill_logits(model: CausalLM, ids: list[int], block_size: int = 4) -> torch.Tensor:
    num_blocks = -(-len(ids) // block_size)
    kv = new_kv_cache(model.config, num_blocks, block_size)
    table = list(range(num_blocks))[::-1]  # block order != position order
    meta, positions = step_meta([table], [0], [len(ids)], block_size)
    attention = TorchPagedAttention().plan(meta)
    return model.compute_logits(model(torch.tensor(ids), positions, meta, kv, attention))


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_prefill_logits_match_transformers(checkpoints, variant):
    hf, ours = checkpoints[variant]
    for n in (WINDOW, 3 * WINDOW + 5):  # all within the window, then most of it outside
        ids = random_ids(n, seed=n)
        got, ref = prefill_logits(ours, ids), hf_logits(hf, ids)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3_pattern"])
def test_chunked_prefill_and_decode_in_a_shared_pool(checkpoints, variant):
    """Two sequences in scattered blocks, run as prefill chunks, a mixed step and decodes: every
    row's logits equal HF's for that position, while the windows slide past earlier chunks."""
    hf, ours = checkpoints[variant]
    block_size = 4
    seqs = [random_ids(27, seed=2), random_ids(19, seed=3)]
    refs = [hf_logits(hf, s) for s in seqs]
    tables = [[9, 2, 14, 5, 0, 11, 16], [7, 3, 12, 1, 8]]  # shuffled, disjoint
    kv = new_kv_cache(ours.config, 17, block_size)
    schedule = [(10, 6), (9, 9), (5, 3), (1, 1), (1, 0), (1, 0)]
    done = [0, 0]
    for new in schedule:
        active = [b for b in range(2) if new[b]]
        meta, positions = step_meta(
            [tables[b] for b in active],
            [done[b] for b in active],
            [new[b] for b in active],
            block_size,
        )
        ids = torch.tensor([t for b in active for t in seqs[b][done[b] : done[b] + new[b]]])
        with torch.no_grad():
            logits = ours.compute_logits(
                ours(ids, positions, meta, kv, TorchPagedAttention().plan(meta))
            )
        row = 0
        for b in active:
            want = refs[b][done[b] : done[b] + new[b]]
            torch.testing.assert_close(logits[row : row + new[b]], want, atol=ATOL, rtol=0)
            row += new[b]
            done[b] += new[b]
    assert done == [27, 19]


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_greedy_matches_generate_past_the_window(checkpoints, variant):
    hf, ours = checkpoints[variant]
    for prompt_len, new in [(5, 20), (30, 12)]:  # the window slides during decode / prefill
        prompt = random_ids(prompt_len, seed=prompt_len)
        with torch.no_grad():
            assert paged_greedy(ours, prompt, new) == hf_greedy(hf, prompt, new)


@pytest.mark.parametrize(
    ("variant", "change"),
    [
        ("gemma2", {"attn_logit_softcap": None}),
        ("gemma2", {"final_logit_softcap": None}),
        ("gemma2", {"attn_scale": None}),
        ("gemma2", {"layer_windows": ()}),
        ("gemma3_pattern", {"local_rope_theta": None}),
        ("gemma3_pattern", {"layer_windows": (WINDOW,) * 4}),
    ],
)
def test_each_feature_changes_the_logits(checkpoints, variant, change):
    """The features are visible at these sizes: with one dropped or changed, logits move."""
    hf, ours = checkpoints[variant]
    other = build_model(replace(ours.config, **change), max_positions=MAX_POSITIONS)
    other.load_state_dict(ours.state_dict())
    ids = random_ids(3 * WINDOW, seed=7)
    assert (prefill_logits(other, ids) - hf_logits(hf, ids)).abs().max() > 100 * ATOL


@pytest.mark.parametrize("tower", [True, False], ids=["with_tower", "text_only"])
def test_multimodal_gemma3_folder_runs_its_text_model(tmp_path, tower):
    """A Gemma3ForConditionalGeneration folder: text_config is read and the text logits equal
    HF's model on the same ids. With its vision_config it is the family with images
    (tests/model/test_gemma3_vl.py); without, the image tower's tensors are skipped."""
    hf = build_gemma3_multimodal()
    hf.save_pretrained(tmp_path)
    if not tower:
        raw = json.loads((tmp_path / "config.json").read_text())
        del raw["vision_config"]
        (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, cfg = load_hf_model(tmp_path, torch.float32, "cpu", MAX_POSITIONS)
    assert cfg.family == ("gemma3_vl" if tower else "gemma3") and (cfg.vision is None) != tower
    assert cfg.num_layers == 6 and cfg.local_rope_theta == 10000.0
    ids = random_ids(3 * WINDOW, seed=11, vocab=300)  # no image tokens
    torch.testing.assert_close(prefill_logits(ours, ids), hf_logits(hf, ids), atol=ATOL, rtol=0)


# A gemma-3-4b-it style config.json: the text_config states only what differs from the
# defaults, and the rope scaling is the transformers 4 layout.
HUB_STYLE_GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_sparse_gemma3_config_reads_as_transformers_reads_it():
    ours = model_config_from_hf(HUB_STYLE_GEMMA3)
    text = Gemma3Config(**HUB_STYLE_GEMMA3).text_config
    rope = text.rope_parameters
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
        text.vocab_size,
    )
    assert ours.layer_windows == tuple(
        text.sliding_window if t == "sliding_attention" else None for t in text.layer_types
    )
    assert ours.rope_theta == rope["full_attention"]["rope_theta"]
    assert ours.local_rope_theta == rope["sliding_attention"]["rope_theta"]
    assert ours.rope_scaling.kind == "linear"
    assert ours.rope_scaling.factor == rope["full_attention"]["factor"]
    assert ours.attn_scale == text.query_pre_attn_scalar**-0.5
    assert ours.final_logit_softcap == text.final_logit_softcapping  # None
    assert ours.rms_norm_eps == text.rms_norm_eps and ours.tie_word_embeddings
    assert ours.max_model_len <= text.max_position_embeddings  # the scaling is already counted
    assert ours.eos_token_ids == (1, 106) and ours.torch_dtype == "bfloat16"


def test_transformers_4_and_5_layouts_read_alike(checkpoints):
    """The saved (transformers 5) config and its transformers 4 spelling: top-level rope_theta,
    rope_local_base_freq, rope_scaling for the global layers, sliding_window_pattern."""
    hf, ours = checkpoints["gemma3_pattern"]
    new = hf.config.to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=5000.0, rope_local_base_freq=100.0, sliding_window_pattern=2)
    assert model_config_from_hf(old) == model_config_from_hf(new) == ours.config


@pytest.mark.parametrize(
    ("patch", "error", "match"),
    [
        ({"use_bidirectional_attention": True}, UnsupportedModelError, "embedding model"),
        ({"hidden_activation": "gelu"}, UnsupportedModelError, "hidden_activation 'gelu'"),
        ({"hidden_size": None}, ValueError, "lacks hidden_size"),
        ({"layer_types": ["sliding_attention"]}, ValueError, "each of the 4 layers"),
        ({"sliding_window": None}, UnsupportedModelError, "without a sliding_window"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            UnsupportedModelError,
            "sliding-window layers",
        ),
    ],
)
def test_unsupported_gemma_configs_are_refused(checkpoints, patch, error, match):
    config = {**checkpoints["gemma3_pattern"][0].config.to_dict(), **patch}
    with pytest.raises(error, match=match):
        model_config_from_hf(config)


@pytest.mark.parametrize("variant", ["gemma2_gguf", "gemma3"])
def test_gguf_decodes_as_the_hf_folder(tmp_path, variant):
    """A GGUF written as llama.cpp's converter does (norms as 1 + w, F16 matrices, Q8_0 token
    embedding) reads back to the same config and the same greedy tokens as the HF folder of the
    same (rounded) weights, and both equal HF's generate."""
    hf = build_gemma(variant)
    gguf_model, gguf_cfg = load_gguf_model(
        write_gemma_gguf(hf, tmp_path / "m.gguf"), torch.float32, "cpu", MAX_POSITIONS
    )
    hf.save_pretrained(tmp_path / "hf")
    folder_model, folder_cfg = load_hf_model(tmp_path / "hf", torch.float32, "cpu", MAX_POSITIONS)
    same = ("layer_windows", "attn_scale", "attn_logit_softcap", "final_logit_softcap")
    same += ("local_rope_theta", "rope_theta", "rope_scaling", "tie_word_embeddings")
    assert {k: getattr(gguf_cfg, k) for k in same} == {k: getattr(folder_cfg, k) for k in same}
    ids = random_ids(3 * WINDOW, seed=5)
    torch.testing.assert_close(
        prefill_logits(gguf_model, ids), hf_logits(hf, ids), atol=ATOL, rtol=0
    )
    for prompt in (random_ids(4, seed=4), random_ids(30, seed=30)):
        with torch.no_grad():
            want = hf_greedy(hf, prompt, 16)
            assert paged_greedy(gguf_model, prompt, 16) == want
            assert paged_greedy(folder_model, prompt, 16) == want


@pytest.mark.parametrize(("family", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_gguf_27b_attention_scale_follows_llama_cpp(family, layers):
    """llama.cpp scales the 27B models' queries by (hidden / heads) ** -0.5 (their
    query_pre_attn_scalar), every other Gemma by head_dim ** -0.5."""
    base = ModelConfig(
        vocab_size=8, hidden_size=4608, intermediate_size=8, num_layers=layers, num_heads=32,
        num_kv_heads=16, head_dim=128, family=family,
    )  # fmt: skip
    meta = {"attention.sliding_window": 4096}
    big = gemma_gguf_config(base, lambda k, d=None: meta.get(k, d))
    small = gemma_gguf_config(
        replace(base, num_layers=layers - 4), lambda k, d=None: meta.get(k, d)
    )
    assert big.attn_scale == 144**-0.5 and small.attn_scale == 128**-0.5
    assert [w is None for w in big.layer_windows[:6]] == (
        [False, True] * 3 if family == "gemma2" else [False] * 5 + [True]
    )


@pytest.mark.parametrize(("variant", "backend"), [("gemma2", "auto"), ("gemma3", "torch")])
def test_engine_matches_generate(tmp_path, variant, backend):
    """The whole engine, prompts and outputs well past the window, batched: on the CPU backend
    (auto on a CPU) and the torch backend, every sequence equals HF's generate."""
    tokenizer = tiny_tokenizer()
    hf = build_gemma(variant, vocab_size=len(tokenizer))
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        block_size=4,
        kv_cache_memory=2**22,
        attention_backend=backend,
    )
    llm.engine.check_integrity_each_step = True
    want = CpuPagedAttention if backend == "auto" else TorchPagedAttention
    assert isinstance(llm.engine.runner.attention, want)
    prompts = [random_ids(n, seed=n, vocab=len(tokenizer)) for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    with torch.no_grad():
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 12) for p in prompts]
