"""linear_backend="auto" measures: each shape bound to the candidate with the best relative
times (checked against a brute-force ranking), gated MLPs fused only where fusing wins, the
choices cached on disk (a second bind times nothing; a changed torch build or kernel measures
again), the bound layers computing what F.linear does, and the choices in llm.stats."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batchpage.ops.measured_linear as measured_linear
from batchpage import LLM, SamplingParams
from batchpage.ops.dequantized_linear import DequantizedLinear
from batchpage.ops.linear import LinearOp, dense_linear
from batchpage.ops.linear_method import MEASURABLE_TORCH_LINEARS, LinearMethod, torch_int_linear
from batchpage.ops.linear_timing import RowTimes
from batchpage.ops.measured_linear import (
    UNFUSED,
    ActivatedLinear,
    ChoiceCache,
    DenseWithRows,
    MeasuredLinears,
    fastest,
    setup_key,
)
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs

CPU = torch.device("cpu")


def brute_force_fastest(timings: dict[str, list[float]]) -> str:
    """The candidate with the smallest product of its time ratios to the best (the geometric
    mean's order), by plain products over every candidate."""
    n = len(next(iter(timings.values())))
    best = [min(t[i] for t in timings.values()) for i in range(n)]
    products = {name: math.prod(t[i] / best[i] for i in range(n)) for name, t in timings.items()}
    return min(timings, key=lambda name: products[name])


@pytest.mark.parametrize("seed", range(20))
def test_fastest_is_the_best_geometric_mean_of_relative_times(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    names = ["a", "b", "c"][: 2 + seed % 2]
    timings = {n: (torch.rand(4, generator=gen) + 0.01).tolist() for n in names}
    assert fastest(timings) == brute_force_fastest(timings)
    # A candidate fastest at every row count wins whatever the others' spread.
    assert fastest({"x": [1.0, 2.0, 3.0], "y": [1.1, 200.0, 3.3]}) == "x"


class Tagged(LinearOp):
    """A fake candidate's layer: F.linear, tagged with its candidate's name (no weight_rows)."""

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.name, self.weight, self.bias = name, weight, bias

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_format(self) -> str:
        return "f32"


def fake(name: str, fused: bool = False) -> LinearMethod:
    silu = (lambda w: Tagged(f"{name}+fused", w, None)) if fused else None
    return LinearMethod(name, lambda w, b: Tagged(name, w, b), silu, version=f"{name}-v1")


@pytest.fixture
def speeds(monkeypatch):
    """Timing by the layer's tag: `speeds[tag]` seconds a row count, every call counted."""
    table: dict[str, float] = {}
    calls: list[str] = []

    def timed(modules: dict, rows: int, in_features: int, dtype: torch.dtype, *_) -> RowTimes:
        times = {}
        for name, module in modules.items():
            if isinstance(module, DenseWithRows):
                module = module.dense
            if isinstance(module, DequantizedLinear):
                module = module.inner
            inner = isinstance(module, ActivatedLinear)
            tag = module.inner.name + "+act" if inner else module.name
            calls.append(tag)
            times[name] = [table[tag] * rows] * 3
        return RowTimes(times, ran=1.0, waited=0.0, load=0.1)  # a quiet machine, no spread

    monkeypatch.setattr(measured_linear, "time_linears", timed)
    return table, calls


def test_each_shape_gets_the_fastest_and_a_second_bind_only_spot_checks(
    tmp_path: Path, speeds
) -> None:
    table, calls = speeds
    table.update({"a": 2.0, "b": 1.0, "a+fused": 0.5, "b+act": 3.0})
    candidates = [fake("a", fused=True), fake("b")]
    rows = (1, 8)

    def bind() -> tuple[MeasuredLinears, LinearMethod]:
        key = setup_key(candidates, torch.float32, rows)
        m = MeasuredLinears(candidates, torch.float32, rows, ChoiceCache(key, tmp_path))
        return m, m.method()

    m, method = bind()
    w, b = torch.randn(6, 4), torch.randn(6)
    assert method.make(w, b).name == "b" and method.make(w, None).name == "b"
    fused = method.silu_mul(torch.randn(8, 4))
    assert fused is not None and fused.name == "a+fused"
    assert m.choices == {"6x4+bias": "b", "6x4": "b", "silu_mul:8x4": "a"}
    assert m.measured == 4 and calls
    calls.clear()
    again, method = bind()  # another engine on the same setup: every choice from the cache
    assert method.make(w, b).name == "b" and method.silu_mul(torch.randn(8, 4)) is not None
    # Nothing measured in full: each cached choice timed once against its runner-up (the
    # fused gate/up against the plain 8x4 linear and the activation, which spot-checks 8x4).
    assert again.measured == 0
    assert sorted(calls) == sorted(["b", "a", "b", "a", "a+fused", "b+act"])
    assert again.choices == {"6x4+bias": "b", "silu_mul:8x4": "a"}
    shapes = again.report()["shapes"]
    assert {s: n["how"] for s, n in shapes.items()} == {
        "6x4+bias": "cached",
        "silu_mul:8x4": "cached",
    }
    assert shapes["6x4+bias"]["spot_rival"] == "a" and shapes["6x4+bias"]["load"] == 0.1
    table["a+fused"] = 9.0  # fusing loses now; a new kernel version measures again
    candidates[0] = LinearMethod("a", candidates[0].make, candidates[0].silu_mul, version="v2")
    fresh, method = bind()
    assert method.silu_mul(torch.randn(8, 4)) is None  # bind then makes the plain linear
    assert fresh.measured == 2 and "silu_mul:8x4" in fresh.choices


def test_a_changed_torch_build_cpu_or_thread_count_measures_again(
    tmp_path: Path, monkeypatch
) -> None:
    candidates = [fake("a"), fake("b")]
    base = setup_key(candidates, torch.float32, (1,))
    ChoiceCache(base, tmp_path).put("4x4", "a")
    assert ChoiceCache(base, tmp_path).get("4x4") == "a"
    monkeypatch.setattr(measured_linear.torch, "__version__", "9.9.9")
    assert ChoiceCache(setup_key(candidates, torch.float32, (1,)), tmp_path).get("4x4") is None
    monkeypatch.undo()
    monkeypatch.setattr(measured_linear, "cpu_model", lambda: "another CPU")
    assert ChoiceCache(setup_key(candidates, torch.float32, (1,)), tmp_path).get("4x4") is None
    assert ChoiceCache(setup_key(candidates, torch.bfloat16, (1,)), tmp_path).get("4x4") is None
    threads = torch.get_num_threads()
    try:  # a tensor-parallel rank's share of the cores
        torch.set_num_threads(threads + 1)
        assert ChoiceCache(setup_key(candidates, torch.float32, (1,)), tmp_path).get("4x4") is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_layers_compute_the_linear(tmp_path: Path, dtype: torch.dtype) -> None:
    """Real candidates, really timed: whichever wins computes x @ W.T + b (and the gated
    MLP's SiLU(gate) * up) as F.linear does in float64, within the dtype's rounding."""
    candidates = [MEASURABLE_TORCH_LINEARS]
    if onednn_packs(dtype, CPU):
        candidates.insert(0, ONEDNN_LINEARS)
    key = setup_key(candidates, dtype, (1, 8))
    m = MeasuredLinears(candidates, dtype, (1, 8), ChoiceCache(key, tmp_path))
    w, b, x = torch.randn(48, 32), torch.randn(48), torch.randn(5, 32)
    layer = m.method().make(w.to(dtype), b.to(dtype))
    want = F.linear(x.double(), w.to(dtype).double(), b.to(dtype).double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    got = layer.apply(x.to(dtype), None).double()
    torch.testing.assert_close(got, want, atol=tol * 10, rtol=tol)
    assert m.choices["48x32+bias"] in {c.name for c in candidates}
    act = ActivatedLinear(dense_linear(w, None)).apply(x, None)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    torch.testing.assert_close(act, F.silu(gate) * up)


def test_an_engine_reports_its_choices_and_generates_as_forced_torch(tiny_folder: Path) -> None:
    """Bound by measurement, the engine's greedy tokens are the torch backend's (float32: the
    candidates differ by summation order only), and llm.stats names each shape's choice."""
    args = {"dtype": "float32", "kv_cache_memory": 2**22}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
    auto = LLM(str(tiny_folder), **args)
    forced = LLM(str(tiny_folder), linear_backend="torch", **args)
    outs = [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)]
    refs = [o.outputs[0].token_ids for o in forced.generate(prompts, params, use_tqdm=False)]
    assert outs == refs
    methods = auto.stats["linear_methods"]
    mc = auto.model_config
    assert f"{mc.hidden_size}x{mc.hidden_size}" in "".join(methods)  # o_proj's shape
    assert set(methods.values()) <= {"torch", "onednn", "avx512_bf16", "cpu_f32", UNFUSED}
    assert forced.stats["linear_methods"] == {"*": "torch"}


def test_every_combination_of_fused_and_plain_times_picks_the_faster(
    tmp_path: Path, speeds
) -> None:
    table, _ = speeds
    for fused_s, plain_s in itertools.product([0.5, 2.0], [1.0]):
        table.update({"a": plain_s, "a+fused": fused_s, "a+act": plain_s, "b": 10.0})
        folder = tmp_path / f"{fused_s}"
        candidates = [fake("a", fused=True), fake("b")]
        key = setup_key(candidates, torch.float32, (1,))
        m = MeasuredLinears(candidates, torch.float32, (1,), ChoiceCache(key, folder))
        made = m.method().silu_mul(torch.randn(8, 4))
        assert (made is not None) == (fused_s < plain_s)


def test_one_candidate_is_forced_unmeasured(tmp_path: Path, speeds) -> None:
    """A forced backend: its own layers (fused always where it fuses), nothing timed, and its
    name for every dense shape in the report."""
    _, calls = speeds
    only = fake("a", fused=True)
    m = MeasuredLinears([only], torch.float32, (1,), ChoiceCache({}, tmp_path))
    method = m.method()
    assert m.forced and method.make is only.make and method.silu_mul is only.silu_mul
    assert method.make_int is torch_int_linear and calls == [] and m.choices == {}


class FakeInt:
    """A fake int implementation's layer: x @ W.T from the dequantized weight, tagged."""

    def __init__(self, name: str, weight) -> None:
        self.name = name
        self.dense = weight.dequantize(torch.float32)
        self.out_features, self.in_features = self.dense.shape

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dense)


def int_candidate(name: str, rows: bool = True):
    from batchpage.ops.linear_method import IntCandidate

    return IntCandidate(name, lambda w, b, s: FakeInt(name, w), lambda w, s: True, "v1", rows)


def test_a_quantized_layer_is_held_dense_only_where_allowed_and_faster(
    tmp_path: Path, speeds
) -> None:
    """Quantized layers: measured among the int candidates that take them, and against their
    own dense form on the fastest dense candidate where `dense_ints`; a layer whose rows are
    read (a tied head) only on candidates that give them back cheaply, or dense beside the
    first of those for its rows; a dense
    shape measured only for that comparison is not reported."""
    from batchpage.quant.scheme import QuantScheme
    from tests.ops.test_onednn_int8_linear import random_weight

    table, calls = speeds
    table.update({"a": 1.0, "b": 3.0, "i16": 2.0, "slow_rows": 0.5})
    w = random_weight(6, 8, 4, 8, False, seed=1)
    scheme = QuantScheme("gptq", 4, None, True, False)
    ints = [int_candidate("i16"), int_candidate("slow_rows", rows=False)]

    def measured(dense_ints: bool) -> MeasuredLinears:
        dense = [fake("a"), fake("b")]
        key = {**setup_key([*dense, *ints], torch.float32, (1,)), "dense": str(dense_ints)}
        cache = ChoiceCache(key, tmp_path)
        return MeasuredLinears(dense, torch.float32, (1,), cache, ints, dense_ints)

    m = measured(dense_ints=True)
    assert m.method().make_int(w, None, scheme).name == "slow_rows"  # the fastest of all
    assert m.choices == {"gptq_int4:6x8/8": "slow_rows"}  # the dense 6x8 was only measured
    head = m.method().make_int(w, None, scheme, reads_rows=True)
    # Not the one whose rows are slow: dense for the matmul, the int module for the rows.
    assert isinstance(head, DenseWithRows)
    assert head.dense.inner.name == "a" and head.rows.name == "i16"  # the dense: dequantized once
    table["slow_rows"] = 9.0
    fresh = measured(dense_ints=True)
    fresh.cache.path.unlink()
    layer = fresh.method().make_int(w, None, scheme)
    assert layer.inner.name == "a" and fresh.choices == {"gptq_int4:6x8/8": "dense", "6x8": "a"}
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer.apply(x, None), F.linear(x, w.dequantize(torch.float32)))
    off = measured(dense_ints=False)  # another cache key: measured again, without dense
    assert off.method().make_int(w, None, scheme).name == "i16"
    assert off.measured == 1
