"""Which implementation of each op an engine binds its model to, chosen once at setup from its
device, dtype and options."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch

from batchpage.ops.bf16_linear import bf16_dot_kernel, bf16_linears
from batchpage.ops.collective import Collective
from batchpage.ops.dequantized_linear import dequantized_linears
from batchpage.ops.int_linear import cpu_int_linears
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.linear import TORCH_LINEARS, LinearMethod
from batchpage.ops.onednn_linear import ONEDNN_LINEARS, onednn_packs

LINEAR_BACKENDS = ("auto", "avx512_bf16", "onednn", "torch")


@dataclass(frozen=True)
class ModelOps:
    """What `CausalLM.bind` binds a model to: the layers' elementwise ops, its linears, and
    the collectives of its tensor-parallel group (a single rank's: none)."""

    layer: LayerOps
    linear: LinearMethod
    comm: Collective = field(default_factory=Collective)


def select_linears(choice: str, dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """The engine's `linear_backend`: "avx512_bf16" is the bf16 kernel (with SiLU(gate) * up
    fused into the gate/up linear) or raises; "onednn" is oneDNN's prepacked layout or raises;
    "torch" keeps the dense weights and dequantizes quantized ones; "auto" takes the first that
    applies: the bf16 kernel (bf16 on AVX512-BF16), oneDNN (wherever it packs this dtype on a
    CPU), torch. Every choice but "torch" runs a quantized checkpoint's linears on the C++ int
    kernel where it applies (bf16 on a CPU with AVX512-BF16 or AVX2); on a CPU where it does not
    (float32), their weights are dequantized once, at bind (ops/dequantized_linear.py)."""
    if choice not in LINEAR_BACKENDS:
        allowed = ", ".join(LINEAR_BACKENDS)
        raise ValueError(f"linear_backend must be one of {allowed}; got {choice!r}")
    if choice == "torch":
        return TORCH_LINEARS
    make_int = cpu_int_linears(dtype, device)
    if make_int is None and device.type == "cpu":
        make_int = dequantized_linears(dtype)
    return replace(_dense_linears(choice, dtype, device), make_int=make_int)


def _dense_linears(choice: str, dtype: torch.dtype, device: torch.device) -> LinearMethod:
    if choice in ("auto", "avx512_bf16"):
        kernel = bf16_dot_kernel(dtype, device, required=choice == "avx512_bf16")
        if kernel is not None:
            return bf16_linears(kernel)
    packs = onednn_packs(dtype, device)
    if choice == "onednn" and not packs:
        raise ValueError(
            f"linear_backend='onednn' cannot pack {str(dtype).removeprefix('torch.')} weights on "
            f"{device}: it needs a CPU torch built with oneDNN, and for bfloat16 a CPU with "
            "AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; use linear_backend='auto' or 'torch'"
        )
    return ONEDNN_LINEARS if packs else TORCH_LINEARS


def select_layer_ops(cpu_kernels: bool) -> LayerOps:
    """The C++ layer ops where the engine runs the C++ attention kernels (`cpu_kernels`): a CPU
    engine with attention_backend='torch' stays all torch. torch's, with a warning, when they do
    not build here."""
    if not cpu_kernels:
        return LayerOps()
    from batchpage.kernels.cpu_build import KernelBuildError
    from batchpage.kernels.cpu_layer_ops import CpuLayerOps
    from batchpage.ops.cpu_layer_ops import CpuKernelLayerOps

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
) -> ModelOps:
    return ModelOps(
        select_layer_ops(cpu_kernels),
        select_linears(linear_backend, dtype, device),
        comm or Collective(),
    )
