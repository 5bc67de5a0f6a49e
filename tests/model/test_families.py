"""Every family against HF transformers on the same random weights, through the paged cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.model.config import FAMILIES
from batchpage.model.families import MODEL_CLASSES, build_model
from batchpage.model.hf_config import model_config_from_hf
from batchpage.model.hf_loader import load_hf_model
from batchpage.model.moe import SparseMoE
from batchpage.ops.compiled_layer_ops import CpuKernelLayerOps
from batchpage.ops.linear_method import TORCH_LINEARS
from batchpage.ops.select import ModelOps
from tests.model_factory import (
    LENGTH_DEPENDENT_ROPE,
    VARIANTS,
    build_hf_model,
    hf_greedy,
    hf_logits,
    hf_stepwise_greedy,
    new_kv_cache,
    paged_greedy,
    prefill_logits,
    save_hf_folder,
    step_meta,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """variant -> (HF model, our model loaded from its saved folder, unbound: torch's ops)."""
    out = {}
    for variant in VARIANTS:
        hf = build_hf_model(variant)
        folder = save_hf_folder(hf, tmp_path_factory.mktemp(variant))
        out[variant] = (hf, load_hf_model(folder, torch.float32, "cpu")[0], folder)
    return out


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_family_in_the_table_has_a_class():
    assert set(FAMILIES.values()) == set(MODEL_CLASSES)
    assert all(cls.family == name for name, cls in MODEL_CLASSES.items())


@pytest.fixture(scope="module")
def layer_ops() -> CpuLayerOps:
    return CpuLayerOps.build()


@pytest.mark.parametrize("with_ops", [False, True], ids=["torch", "cpu_layer_ops"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(checkpoints, layer_ops, variant, with_ops):
    """Each family against HF, with its norms, activations and rope in torch (unbound), then
    bound to the C++ CPU ops (kernels/cpu_layer_ops.py) that a CPU engine uses."""
    hf, ours, folder = checkpoints[variant]
    assert ours.config.family == MODEL_CLASSES[ours.config.family].family
    if with_ops:
        ours = load_hf_model(folder, torch.float32, "cpu")[0]
        ours.bind(ModelOps(CpuKernelLayerOps(layer_ops), TORCH_LINEARS))
    for n in (20, 45):  # 45 > the 32-token original length of the scaled-rope variants
        ids = random_ids(n, seed=n)
        ref = hf_logits(hf, ids)
        got = prefill_logits(ours, ids)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "variant",
    [
        "llama_gqa_tied",
        "qwen2_bias_gqa",
        "llama_hd80_mqa",
        "qwen3_tied",
        "phi4_mini_partial",
        "qwen3_moe",
        "mixtral",
    ],
)
def test_chunked_prefill_and_decode_in_a_shared_pool(checkpoints, variant):
    """Two sequences in scattered blocks, run as prefill chunks, then mixed steps, then decodes:
    every row's logits equal HF's logits for that position of the full sequence."""
    hf, ours, _ = checkpoints[variant]
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
            attention = TorchPagedAttention().plan(meta)
            logits = ours.compute_logits(ours(ids, positions, meta, kv, attention))
        row = 0
        for b in active:
            want = refs[b][done[b] : done[b] + new[b]]
            torch.testing.assert_close(logits[row : row + new[b]], want, atol=ATOL, rtol=0)
            row += new[b]
            done[b] += new[b]
    assert done == [23, 17]


@pytest.mark.parametrize("variant", LENGTH_DEPENDENT_ROPE + ("qwen3_bias_yarn",))
def test_greedy_below_and_past_the_original_length_matches_generate(checkpoints, variant):
    """A sequence that stays within the 32-token original length, and one that starts past it:
    each token's rope follows its sequence's length at its own step, as in HF's generate."""
    hf, ours, _ = checkpoints[variant]
    for prompt_len, new in [(20, 12), (40, 16)]:
        prompt = random_ids(prompt_len, seed=prompt_len)
        with torch.no_grad():
            assert paged_greedy(ours, prompt, new) == hf_greedy(hf, prompt, new)


@pytest.mark.parametrize("variant", LENGTH_DEPENDENT_ROPE)
def test_greedy_across_the_original_length_matches_hf_forward(checkpoints, variant):
    """A sequence that crosses the original length while decoding keeps the K/V computed before
    the crossing, as HF's own forward with its cache does (HF's Phi-3 `generate` instead drops
    its cache once at the crossing and recomputes every token with the long factors)."""
    hf, ours, _ = checkpoints[variant]
    prompt = random_ids(20, seed=20)
    with torch.no_grad():
        assert paged_greedy(ours, prompt, 30) == hf_stepwise_greedy(hf, prompt, 30)


def test_scaled_rope_variants_differ_from_plain_rope(checkpoints):
    """The rope variants matter at these sizes: with the scaling dropped, logits move."""
    ids = random_ids(45, seed=45)
    for variant in ("llama_linear_rope", "llama_dynamic_rope", "qwen3_bias_yarn", "phi3_longrope"):
        hf, ours, _ = checkpoints[variant]
        plain = build_model(replace(ours.config, rope_scaling=None), max_positions=64)
        plain.load_state_dict(ours.state_dict())
        assert (prefill_logits(plain, ids) - hf_logits(hf, ids)).abs().max() > 100 * ATOL


def test_moe_layers_follow_the_sparse_layout(checkpoints):
    for variant, sparse in [("qwen3_moe", [True, False, True]), ("qwen3_moe_step2", [False, True])]:
        ours = checkpoints[variant][1]
        assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == sparse


def test_bfloat16_model_tracks_float32(tmp_path):
    hf = build_hf_model("qwen3_tied")
    folder = save_hf_folder(hf, tmp_path)
    model, _ = load_hf_model(folder, torch.bfloat16, "cpu")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.cos.dtype == torch.float32  # tables stay float32 in a bf16 model
    ids = random_ids(20, seed=4)
    got, ref = prefill_logits(model, ids), hf_logits(hf, ids)
    assert got.dtype == torch.bfloat16  # the lm_head's, as HF's; the sampler widens what it uses
    assert (got.float() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("variant", ["llama_bias_untied", "mixtral"])
def test_load_weights_rejects_missing_and_misshapen(tmp_path, variant):
    hf = build_hf_model(variant)
    save_hf_folder(hf, tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")  # the checkpoint's own names
    cfg = model_config_from_hf(hf.config.to_dict())
    no_head = [(k, v) for k, v in state.items() if k != "lm_head.weight"]
    with pytest.raises(ValueError, match="missing weights.*lm_head"):
        build_model(cfg).load_weights(no_head)
    expert = next(k for k in state if ".experts." in k or ".q_proj." in k)
    no_expert = [(k, v) for k, v in state.items() if k != expert]
    with pytest.raises(ValueError, match="missing weights.*layers.0"):
        build_model(cfg).load_weights(no_expert)
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        build_model(cfg).load_weights(bad.items())
    with pytest.raises(ValueError, match="unexpected weight"):
        build_model(cfg).load_weights([*state.items(), ("model.extra.weight", torch.ones(1))])
