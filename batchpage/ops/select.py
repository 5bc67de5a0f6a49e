"""Which implementation of each op an engine binds its model to, chosen once at setup from its
device, dtype and options."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from batchpage.ops.bf16_linear import bf16_dot_kernel, bf16_linears
from batchpage.ops.choice_cache import ChoiceCache
from batchpage.ops.collective import Collective
from batchpage.ops.dequantized_linear import dequantized_linears
from batchpage.ops.f32_linear import f32_kernel, f32_linears
from batchpage.ops.int_linear import cpu_int_candidates
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear_method import MEASURABLE_TORCH_LINEARS, TORCH_LINEARS, LinearMethod
from batchpage.ops.measured_linear import MeasuredLinears, setup_key
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs
from batchpage.ops.triton_int_linear import triton_int_candidates
from batchpage.ops.triton_linear import TRITON_LINEARS

LINEAR_BACKENDS = ("auto", "avx512_bf16", "cpu_f32", "onednn", "torch", "triton")


@dataclass(frozen=True)
class ModelOps:
    """What `CausalLM.bind` binds a model to: the layers' elementwise ops, its linears, and
    the collectives of its tensor-parallel group (a single rank's: none)."""

    layer: LayerOps
    linear: LinearMethod
    comm: Collective = field(default_factory=Collective)
    # What was chosen per shape once bound: by measurement among several dense candidates
    # (linear_backend="auto") and among the int ones that take a quantized layer.
    measured: MeasuredLinears | None = None

    def linear_methods(self) -> dict[str, str]:
        """The implementation bound per linear shape (llm.stats' linear_methods); "*" for a
        forced backend's every dense shape."""
        measured = self.measured
        if measured is None or measured.forced:
            return {"*": self.linear.name, **(measured.choices if measured else {})}
        return dict(measured.choices)

    def linear_measurement(self) -> dict[str, Any]:
        """How the measured choices were made, per shape, and the load they were measured
        under (MeasuredLinears.report: llm.stats' and run.json's linear_measurement); {} where
        nothing was chosen among several."""
        return self.measured.report() if self.measured is not None else {}


def select_linears(
    choice: str,
    dtype: torch.dtype,
    device: torch.device,
    rows: tuple[int, ...] = (1, 64),
    dense_ints: bool = False,
    batch_invariant: bool = False,
    dequantize: bool = False,
) -> tuple[LinearMethod, MeasuredLinears | None]:
    """The engine's `linear_backend`: "avx512_bf16" is the bf16 kernel (with SiLU(gate) * up
    fused into the gate/up linear) or raises; "cpu_f32" the float32 kernel or raises;
    "onednn" is oneDNN's prepacked layout or raises; "triton" the batch-invariant Triton
    matmul (a GPU's, or a CPU's under Triton's interpreter: tests), its quantized linears on the
    Triton int kernel;
    "torch" keeps the dense weights and dequantizes quantized ones; "auto" measures, for each
    linear shape at bind, every one of them that can run here at the row counts `rows`, and
    binds the fastest (ops/measured_linear.py; the MeasuredLinears is returned for its report).
    Every choice but "torch" runs a quantized checkpoint's linears on the int implementations
    that run here (ops/int_linear.py; on a GPU the Triton int kernel, ops/triton_int_linear.py),
    each layer on the one measured fastest for its shape;
    on a CPU where none does (float32), their weights are dequantized once, at bind
    (ops/dequantized_linear.py). `dense_ints` (under "auto" only): a quantized layer's own
    dense form is a candidate too (the caller has checked that the memory allows it).
    `batch_invariant`: only implementations whose rows do not depend on the batch (each
    output one fixed-order sum) are candidates, on a GPU the Triton matmul; none for this
    dtype here raises, saying why. `dequantize` (quantized_weights=False): every quantized
    layer is dequantized once, at bind, onto the dense method."""
    if choice not in LINEAR_BACKENDS:
        allowed = ", ".join(LINEAR_BACKENDS)
        raise ValueError(f"linear_backend must be one of {allowed}; got {choice!r}")
    if choice == "torch" and not batch_invariant:
        if dequantize:
            return replace(TORCH_LINEARS, make_int=dequantized_linears(dtype)), None
        return TORCH_LINEARS, None
    if choice == "triton" or device.type == "cuda":
        ints = triton_int_candidates(dtype)
    else:
        ints = cpu_int_candidates(dtype, device)
    dense = _dense(choice, dtype, device)
    if batch_invariant:
        dense, ints = (
            _invariant(choice, dense, dtype, device),
            [c for c in ints if c.batch_invariant],
        )
    if dense == [MEASURABLE_TORCH_LINEARS]:
        dense = [TORCH_LINEARS]  # the only one: the dense Linear as loaded, not remade
    # (a layer's dense form is made on the dense candidates: not on torch's forced one)
    dense_ints = dense_ints and choice == "auto" and bool(ints) and dense[0].make is not None
    key = {**setup_key([*dense, *ints], dtype, rows), "dense_ints": str(dense_ints)}
    measured = MeasuredLinears(dense, dtype, rows, ChoiceCache(key), ints, dense_ints)
    method = measured.method()
    if dequantize or (not ints and device.type == "cpu"):  # then as the dense layers
        method = replace(method, make_int=dequantized_linears(dtype, method.make))
    return method, measured


def check_batch_invariant(choice: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raise the ValueError that binding a batch-invariant engine's linears would (the
    `linear_backend` forced, or the `dtype` here, has no batch-invariant implementation), from
    the config alone: engine/plan.py calls it before any weight loads."""
    _invariant(choice, _dense(choice, dtype, device), dtype, device)


def _dense(choice: str, dtype: torch.dtype, device: torch.device) -> list[LinearMethod]:
    """The dense candidates of `linear_backend=choice`: the forced one, or (auto) every one
    that runs here."""
    if choice != "auto":
        return [_forced_linears(choice, dtype, device)]
    return _candidates(dtype, device)


def _invariant(
    choice: str, dense: list[LinearMethod], dtype: torch.dtype, device: torch.device
) -> list[LinearMethod]:
    """The batch-invariant ones among `dense`, or a one-line reason why there are none."""
    kept = [m for m in dense if m.batch_invariant]
    if kept:
        return kept
    if device.type == "cuda":
        return [TRITON_LINEARS]
    name = str(dtype).removeprefix("torch.")
    if choice != "auto":
        raise ValueError(
            f"batch_invariant=True cannot run linear_backend={choice!r}, whose rows depend on the "
            "batch: use linear_backend='auto'"
        )
    if device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError(
            "batch_invariant=True with bfloat16 needs a CPU with AVX512-BF16 (its bf16 kernel sums "
            "in a fixed order) and a compiler that builds it; use dtype='float32' here"
        )
    raise ValueError(
        f"batch_invariant=True has no batch-invariant linear for {name} on {device.type} yet: "
        "use dtype='float32' on a CPU"
    )


def _forced_linears(choice: str, dtype: torch.dtype, device: torch.device) -> LinearMethod:
    if choice == "torch":
        return TORCH_LINEARS
    if choice == "triton":
        return TRITON_LINEARS
    if choice == "cpu_f32":
        f32 = f32_kernel(dtype, device, required=True)
        assert f32 is not None
        return f32_linears(f32)
    if choice == "avx512_bf16":
        kernel = bf16_dot_kernel(dtype, device, required=True)
        assert kernel is not None
        return bf16_linears(kernel)
    if not onednn_packs(dtype, device):
        raise ValueError(
            f"linear_backend='onednn' cannot pack {str(dtype).removeprefix('torch.')} weights on "
            f"{device}: it needs a CPU torch built with oneDNN, and for bfloat16 a CPU with "
            "AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; use linear_backend='auto' or 'torch'"
        )
    return ONEDNN_LINEARS


def _candidates(dtype: torch.dtype, device: torch.device) -> list[LinearMethod]:
    """Every dense linear implementation that can run `dtype` on `device`: the one that cannot
    is left out by trying it (building the kernel, packing a tiny weight), not by its flags
    alone. Plain torch always can."""
    found = []
    kernel = bf16_dot_kernel(dtype, device, required=False)
    if kernel is not None:
        found.append(bf16_linears(kernel))
    f32 = f32_kernel(dtype, device, required=False)
    if f32 is not None:
        found.append(f32_linears(f32))
    if onednn_packs(dtype, device):
        found.append(ONEDNN_LINEARS)
    return [*found, MEASURABLE_TORCH_LINEARS]


def select_layer_ops(cpu_kernels: bool, triton_norms: bool = False) -> LayerOps:
    """The C++ layer ops where the engine runs the C++ attention kernels (`cpu_kernels`): a CPU
    engine with attention_backend='torch' stays all torch. torch's, with a warning, when they do
    not build here. `triton_norms`: a batch-invariant engine on the Triton attention kernels,
    whose norms run one row per program (ops/triton_layer_ops.py)."""
    if triton_norms:
        from batchpage.ops.triton_layer_ops import TritonLayerOps

        return TritonLayerOps()
    if not cpu_kernels:
        return LayerOps()
    from batchpage.kernels.cpu_build import KernelBuildError
    from batchpage.kernels.cpu_layer_ops import CpuLayerOps
    from batchpage.ops.compiled_layer_ops import CpuKernelLayerOps

    try:
        return CpuKernelLayerOps(CpuLayerOps.build())
    except KernelBuildError as exc:
        warnings.warn(f"{exc}; the layers' norms and activations run in torch", stacklevel=2)
        return LayerOps()


def select_model_ops(
    linear_backend: str,
    cpu_kernels: bool,
    dtype: torch.dtype,
    device: torch.device,
    comm: Collective | None = None,
    rows: tuple[int, ...] = (1, 64),
    dense_ints: bool = False,
    batch_invariant: bool = False,
    triton_attention: bool = False,
    dequantize: bool = False,
) -> ModelOps:
    """`rows`: the row counts a linear runs at that matter, where "auto" measures;
    `dense_ints`, `batch_invariant`, `dequantize`: see select_linears; `triton_attention`: the
    engine runs the Triton attention kernels."""
    linear, measured = select_linears(
        linear_backend, dtype, device, rows, dense_ints, batch_invariant, dequantize
    )
    layer = select_layer_ops(cpu_kernels, triton_norms=batch_invariant and triton_attention)
    return ModelOps(layer, linear, comm or Collective(), measured)
