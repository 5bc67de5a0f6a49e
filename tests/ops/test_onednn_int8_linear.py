"""oneDNN's int8 matmul as a quantized linear (ops/onednn_int8_linear.py) against a float64
reference of the same function, element by element: rows rounded to int8 per row, times the
dequantized weight, scaled, plus bias; its rows read back; that it is offered only where it is
exact at the corner where vpmaddubsw saturates (oneDNN on an AVX2 CPU); and, on a CPU with AMX,
that oneDNN really runs it (and the bf16 linears) on AMX tiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchpage.cpu_info import cpu_flags
from batchpage.kernels.lesser_cpu import lesser_cpu_env
from batchpage.ops.onednn_int8_linear import OneDnnInt8Linear, onednn_int8_candidate, takes
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight, pack_nibbles
from batchpage.quant.scheme import QuantScheme

CPU = torch.device("cpu")
CANDIDATE = onednn_int8_candidate(CPU)
needs_onednn = pytest.mark.skipif(CANDIDATE is None, reason="this torch has no oneDNN int8 linear")


def scheme(bits: int, group: int | None) -> QuantScheme:
    """An asymmetric scheme with int8 activations."""
    return QuantScheme("compressed-tensors", bits, group, False, False, int8_activations=True)


def random_weight(n: int, k: int, bits: int, group: int, perm: bool, seed: int) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    offsets = (torch.rand(n, groups, generator=g) - 0.5) * 0.1
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    order = torch.randperm(k, generator=g) if perm else None
    return IntWeight(packed, scales, offsets, bits, group, k, order)


def reference(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: the rows as int8 values (after act order's permutation) times the stored W."""
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    values, scales = quantize_rows_int8(x)
    y = values.double() @ w.dequantize_stored(torch.float64).T * scales.double()
    return y if bias is None else y + bias.double()


CASES = [(8, False, False), (8, True, True), (4, False, True), (6, True, False)]


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize(("bits", "perm", "bias"), CASES)
def test_matches_the_float64_reference(rows: int, bits: int, perm: bool, bias: bool) -> None:
    n, k = 72, 200
    w = random_weight(n, k, bits, k, perm, seed=rows + bits)
    b = torch.randn(n) if bias else None
    layer = OneDnnInt8Linear(w, b, scheme(bits, None))
    x = torch.randn(rows, k).to(torch.bfloat16)
    want = reference(x, w, b)
    got = layer.apply(x, None)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # Exact int32 sums, float32 scaling: apart by the output's one bf16 rounding.
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    assert layer.apply(x, out) is out and torch.equal(out, got)


@needs_onednn
@pytest.mark.parametrize("perm", [False, True])
def test_weight_rows_read_back_the_dense_weight(perm: bool) -> None:
    w = random_weight(40, 1100, 8, 1100, perm, seed=3)  # past one 1024-column chunk
    layer = OneDnnInt8Linear(w, None, scheme(8, None))
    ids = torch.tensor([0, 39, 7, 7])
    torch.testing.assert_close(
        layer.weight_rows(ids).double(), w.dequantize(torch.float64)[ids], rtol=1e-6, atol=1e-6
    )


def test_takes_only_per_channel_int8_activations() -> None:
    w = random_weight(8, 64, 8, 64, False, seed=0)
    grouped = random_weight(8, 64, 4, 32, False, seed=0)
    assert takes(w, scheme(8, None))
    assert not takes(grouped, scheme(4, 32))
    plain = QuantScheme("compressed-tensors", 8, None, True, False)
    assert not takes(w, plain)


AMX_PROBE = """
import torch
from batchpage.ops.onednn_int8_linear import OneDnnInt8Linear
from batchpage.ops.onednn_linear import OneDnnLinear
from batchpage.quant.scheme import QuantScheme
from tests.ops.test_onednn_int8_linear import random_weight
w = random_weight(256, 256, 8, 256, False, seed=0)
s = QuantScheme("compressed-tensors", 8, None, True, False, int8_activations=True)
OneDnnInt8Linear(w, None, s).apply(torch.randn(64, 256).to(torch.bfloat16), None)
dense = OneDnnLinear(torch.randn(256, 256).to(torch.bfloat16), None)
dense.apply(torch.randn(64, 256).to(torch.bfloat16), None)
"""


AMX = {"amx_int8", "amx_bf16"} <= cpu_flags()


def _probe(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a probe script in a process of its own (oneDNN's ISA and verbose log are set at its
    start), from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        check=True,
    )


@needs_onednn
@pytest.mark.skipif(
    not AMX and "avx512_vnni" not in cpu_flags(), reason="this CPU has neither AMX nor VNNI"
)
def test_onednn_multiplies_on_amx_tiles_where_the_cpu_has_them() -> None:
    """oneDNN's verbose log names the implementation of each primitive it runs: on an AMX CPU
    the int8 and the bf16 matmuls must be its AMX ones (elsewhere the int8 one its VNNI one)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    run = _probe(AMX_PROBE, env)
    # The probe's 64-row products (the layer's own tiny probe at setup may run on other tiles).
    ran = [
        ln
        for ln in run.stdout.splitlines()
        if ",exec," in ln and "reorder" not in ln and ("64x256" in ln or "mb64" in ln)
    ]
    int8 = [ln for ln in ran if "src:u8" in ln]
    bf16 = [ln for ln in ran if "src:bf16" in ln]
    assert int8 and bf16, run.stdout[-2000:]
    if AMX:
        assert all("amx" in ln for ln in int8 + bf16), run.stdout[-2000:]
    else:
        assert all("vnni" in ln or "amx" in ln for ln in int8), run.stdout[-2000:]


CORNER_PROBE = """
import json, torch
from batchpage.ops.onednn_int8_linear import OneDnnInt8Linear, onednn_int8_candidate
from batchpage.quant.activations import quantize_rows_int8
from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme
s = QuantScheme("compressed-tensors", 8, None, True, False, int8_activations=True)
g = torch.Generator().manual_seed(0)
q = torch.randint(0, 256, (64, 256), generator=g)
q[:, ::2] = 255  # W = 127 against xq = 127: byte pairs that sum past 2^15 - 1
w = IntWeight(q.to(torch.uint8), torch.full((64, 1), 0.01), torch.full((64, 1), -1.28),
               8, 256, 256)
x = torch.randn(4, 256, generator=g)
x[:, ::2] = x[:, ::2].abs() + 1
x = x.to(torch.bfloat16)
v, sc = quantize_rows_int8(x)
want = v.double() @ w.dequantize_stored(torch.float64).T * sc.double()
got = OneDnnInt8Linear(w, None, s).apply(x, None).double()
err = float((got - want).abs().max() / want.abs().max())
print(json.dumps({"offered": onednn_int8_candidate(torch.device("cpu")) is not None, "err": err}))
"""


@needs_onednn
@pytest.mark.parametrize("level", [None, "avx2"])
def test_offered_only_where_exact_at_the_saturating_corner(level: str | None) -> None:
    """This CPU, and held to AVX2 (batchpage.kernels.lesser_cpu: oneDNN without VNNI sums byte
    pairs with vpmaddubsw, into int16 that saturate): the candidate is offered exactly where the
    layer's results are its int32 sums' (apart by the bf16 rounding)."""
    env = dict(os.environ)
    if level is not None:
        try:
            env.update(lesser_cpu_env(level))
        except ValueError:
            pytest.skip(f"this CPU cannot act as {level}")
    run = _probe(CORNER_PROBE, env)
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["offered"] == (seen["err"] < 2**-7), seen
    if level is None:  # this CPU's own oneDNN is offered (needs_onednn): exact
        assert seen["offered"]
