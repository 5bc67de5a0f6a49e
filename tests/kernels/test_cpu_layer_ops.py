"""The C++ layer ops (kernels/cpu_layer_ops.cpp and its launcher) against the torch code they
replace: RMSNorm and the residual add (model/layers.py), SiLU(gate) * up, and rope
(model/rope.py's apply_rope), in every dtype, on strided rows and on sizes that leave a vector
tail. The engine with them (attention_backend="cpu") against torch is in test_cpu_paged_decode.py,
each model family against HF in tests/model/test_families.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_layer_ops import CpuLayerOps
from batchpage.kernels.testing import tolerances
from batchpage.model.layers import RMSNorm
from batchpage.model.rope import apply_rope
from batchpage.ops.compiled_layer_ops import CpuKernelLayerOps
from batchpage.ops.layer_ops import LayerOps
from tests.kernels.bench_smoke import run_bench_smoke

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    return CpuLayerOps.build()


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    norm.weight.data = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    return norm


def _rows(n: int, dim: int, dtype: torch.dtype, seed: int, wide: int = 0) -> torch.Tensor:
    """[n, dim] rows, strided when wide > 0 (a column slice of an [n, dim + wide] tensor)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, dim + wide, generator=gen) * 3).to(dtype)
    return x[:, wide // 2 : wide // 2 + dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,wide", [(576, 0), (37, 0), (64, 24)])
def test_rms_norm_matches_torch(ops, dtype, dim, wide):
    norm = _norm(dim, dtype, 1)
    x = _rows(13, dim, dtype, 2, wide)
    assert x.is_contiguous() == (wide == 0)
    got = ops.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, norm(x), **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_sum_and_its_norm(ops, dtype):
    norm = _norm(200, dtype, 3)
    x, residual = _rows(9, 200, dtype, 4, wide=8), _rows(9, 200, dtype, 5)
    total, normed = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(total, x + residual, rtol=0, atol=0)  # one rounding, as torch
    torch.testing.assert_close(normed, norm(x + residual), **tolerances(dtype))
    ref_total, ref_normed = residual.clone(), torch.empty_like(residual)
    LayerOps().add_rms_norm(ref_normed, ref_total, x, norm.weight, norm.eps)  # the torch ops'
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref_normed, **tolerances(dtype))
    # Bound as the layers call it: the sum written over the residual stream in place.
    stream, out = residual.clone(), torch.empty_like(residual)
    CpuKernelLayerOps(ops).add_rms_norm(out, stream, x, norm.weight, norm.eps)
    assert torch.equal(stream, total) and torch.equal(out, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul_matches_torch(ops, dtype, inter):
    gate_up = _rows(7, 2 * inter, dtype, 6, wide=10)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zeros
    gate, up = gate_up.split(inter, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (7, inter) and got.dtype == dtype
    torch.testing.assert_close(got, F.silu(gate) * up, **tolerances(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,rotary", [(64, 64), (80, 64), (96, 24)])
def test_rope_in_place_matches_apply_rope(ops, dtype, dim, rotary):
    """q and k heads as the Attention layer holds them: a slice of the qkv rows, rotated in
    place; a partial rotary dimension leaves the rest of each head alone."""
    n, heads, gen = 11, 5, torch.Generator().manual_seed(7)
    qkv = torch.randn(n, (heads + 2) * dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + 1) * dim].view(n, heads + 1, dim)
    angles = torch.rand(n, 1, rotary // 2, generator=gen) * 20
    cos, sin = angles.cos(), angles.sin()
    ref = apply_rope(qk, cos, sin)
    v_before = qkv[:, (heads + 1) * dim :].clone()
    got = ops.rope_(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # in place, in qkv's rows
    torch.testing.assert_close(got, ref, **tolerances(dtype))
    assert torch.equal(qkv[:, (heads + 1) * dim :], v_before)  # v untouched
    if rotary < dim:
        torch.testing.assert_close(got[..., rotary:], ref[..., rotary:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 37, 5])
def test_argmax_matches_torch(ops, vocab, dtype):
    """Random rows, rows whose largest value repeats (the first index wins), all -inf rows,
    rows with a NaN (its index wins, as in torch), strided rows, and no rows; in each logits
    dtype, against torch's argmax of the float32 copy (bf16's 8-bit mantissa makes ties
    common in the random rows too)."""
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(9, vocab + 3, generator=gen).to(dtype)
    x = wide[:, 1 : vocab + 1]  # strided rows
    x[1] = 0.5  # a tie across the whole row
    x[2, vocab // 3] = x[2, vocab - 1] = 100.0  # two equal maxima
    x[3] = float("-inf")
    x[4, vocab // 2] = float("nan")
    x[5, -1] = float("nan")
    x[5, 0] = float("inf")
    assert not x.is_contiguous()
    expected = x.float().argmax(dim=-1)
    assert torch.equal(ops.argmax(x), expected)
    assert torch.equal(ops.argmax(x.contiguous()), expected)
    assert torch.equal(x.argmax(dim=-1), expected)  # torch agrees in the narrow dtype too
    assert ops.argmax(torch.empty(0, vocab, dtype=dtype)).shape == (0,)


@pytest.mark.parametrize("vocab", [49152, 1000, 37, 1])
def test_race_matches_the_reference(ops, vocab):
    """The C++ exponential race against sampler.exponential_race (the noise tensor, divide,
    argmax in torch): random distributions, ones with zero-probability tokens (never drawn),
    a one-hot row, strided rows; and through the bound layer ops."""
    from batchpage.engine.sampler import draw_keys
    from batchpage.ops.race import exponential_race

    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(12, vocab + 2, generator=gen).mul(3).softmax(-1)
    probs = wide[:, 1 : vocab + 1]  # strided rows
    probs[1, : vocab // 2] = 0.0  # half the vocabulary impossible
    probs[2] = 0.0
    probs[2, vocab // 3] = 1.0  # one-hot
    keys = draw_keys(torch.arange(12).numpy(), torch.arange(12).mul(7).numpy())
    expected = exponential_race(probs.contiguous(), keys)
    assert torch.equal(ops.race(probs, keys), expected)
    assert torch.equal(CpuKernelLayerOps(ops).race(probs, keys), expected)
    assert expected[2].item() == vocab // 3
    assert probs[1, expected[1]].item() > 0
    assert ops.race(torch.empty(0, vocab), keys[:0]).shape == (0,)


def test_launcher_rejects_bad_inputs(ops):
    x = torch.randn(4, 16)
    with pytest.raises(AssertionError):
        ops.rms_norm(x, torch.ones(15), 1e-6)  # weight of the wrong size
    with pytest.raises(AssertionError):
        ops.rms_norm(x.t(), torch.ones(4), 1e-6)  # columns not dense
    with pytest.raises(AssertionError):
        ops.rms_norm(x.double(), torch.ones(16, dtype=torch.double), 1e-6)
    with pytest.raises(AssertionError):
        ops.silu_mul(torch.randn(4, 15))  # no gate/up halves
    with pytest.raises(AssertionError):
        ops.add_rms_norm(x, torch.randn(4, 16, dtype=torch.bfloat16), torch.ones(16), 1e-6)
    qk = torch.randn(3, 2, 8)
    with pytest.raises(AssertionError):
        ops.rope_(qk, torch.ones(3, 1, 5), torch.ones(3, 1, 5))  # rotary 10 > head_dim 8
    with pytest.raises(AssertionError):
        ops.rope_(qk, torch.ones(3, 1, 4, dtype=torch.bfloat16), torch.ones(3, 1, 4))
    with pytest.raises(AssertionError):
        ops.argmax(x.double())  # logits are float32, bf16 or fp16
    with pytest.raises(AssertionError):
        ops.argmax(x.t())  # columns not dense


def test_cpu_engine_uses_the_ops_and_torch_engine_does_not(tmp_path):
    from batchpage import LLM
    from tests.model_factory import build_hf_model, save_hf_folder, tiny_tokenizer

    folder = save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path / "m", tiny_tokenizer())
    for backend, expect in (("cpu", True), ("torch", False)):
        llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=2**22,
                  attention_backend=backend)  # fmt: skip
        model = llm.engine.runner.model
        name = "cpu" if expect else "torch"
        assert model.norm.ops.name == name
        assert all(layer.mlp.ops is model.norm.ops for layer in model.layers)
        assert all(layer.self_attn.ops is model.norm.ops for layer in model.layers)
        assert llm.engine.argmax.__self__ is model.norm.ops  # the greedy sampler's argmax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_ops_benchmark_smoke(ops, tmp_path, dtype) -> None:
    stdout, results = run_bench_smoke(
        "jobs.bench.layer_parts", tmp_path / "layer_ops.json", "--dtype", dtype
    )
    assert "| rows | part | torch (us) | C++ (us) | speed-up |" in stdout
    parts = ["rms_norm", "add + rms_norm", "silu * up", "rope", "argmax"]
    assert [r["part"] for r in results] == parts
    assert all(r["cpu_us"] > 0 and r["torch_us"] > 0 and r["dtype"] == dtype for r in results)


def test_engine_keeps_torch_layers_when_the_ops_cannot_build(monkeypatch) -> None:
    from batchpage.attention.cpu_backend import CpuPagedAttention
    from batchpage.attention.torch_backend import TorchPagedAttention
    from batchpage.engine.model_runner import uses_cpu_kernels
    from batchpage.kernels.cpu_build import KernelBuildError
    from batchpage.kernels.cpu_paged_decode import CpuPagedDecode
    from batchpage.kernels.cpu_paged_prefill import CpuPagedPrefill
    from batchpage.ops.select import select_layer_ops

    attention = CpuPagedAttention(CpuPagedDecode.build(), CpuPagedPrefill.build())

    def fail(cls, verbose: bool = False):
        raise KernelBuildError("no compiler here")

    monkeypatch.setattr(CpuLayerOps, "build", classmethod(fail))
    with pytest.warns(UserWarning, match="no compiler here.*norms and activations run in torch"):
        assert select_layer_ops(uses_cpu_kernels(attention)).name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: torch asked for
        assert select_layer_ops(uses_cpu_kernels(TorchPagedAttention())).name == "torch"
