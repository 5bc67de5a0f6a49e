"""The elementwise parts of a decoder layer for CPUs: the launcher of cpu_layer_ops.cpp (built
once, like the decode kernel, through cpu_build.py).

Why C++: on a CPU each small torch op costs a dispatch and a wake-up of the intra-op threads,
tens of microseconds, as much as its arithmetic at decode batch sizes. torch's RMSNorm is six
ops (float, pow, mean, add, rsqrt, two muls), the gated MLP's activation three (split, silu,
mul), rope five, the residual add one: for a small model at decode batch sizes their dispatch
is a visible share of a step. Each function here is one pass over its rows on torch's threads:
- rms_norm(x, w): w * T(x * rsqrt(mean(x^2) + eps)), float32 statistics (HF's RMSNorm);
- add_rms_norm(x, residual, w): the residual add and the next norm in one pass;
- silu_mul(gate_up): SiLU(gate) * up over the merged [gate | up] matmul output;
- rope_(x, cos, sin): rotate-half rope in place on q and k's heads;
- argmax(logits): each row's argmax, for the greedy sampler (once a step, not once a layer), in
  the logits' own dtype;
- race(probs, keys): each sampled row's token by the exponential race, its noise hashed from the
  row's key in the same pass (no noise tensor, no generator per row).
They compute in float32 and round to the tensors' dtype where the torch code rounds, so they
match torch (model/layers.py, model/rope.py, the references) to float32 rounding in any dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batchpage.kernels.cpu_build import build_extension

SOURCE = Path(__file__).with_name("cpu_layer_ops.cpp")  # shipped in the wheel beside this file

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_rows(x: torch.Tensor) -> None:
    assert x.device.type == "cpu" and x.dtype in DTYPES, (x.device, x.dtype)
    assert x.dim() == 2 and x.stride(1) == 1, "rows must be dense in their last dimension"


class CpuLayerOps:
    """The compiled ops. Build with `CpuLayerOps.build()`."""

    def __init__(self, module: object) -> None:
        self._module = module

    @classmethod
    def build(cls, verbose: bool = False) -> CpuLayerOps:
        """Compiles on first use (kernels/cpu_build.py), then loads the cached library."""
        return cls(build_extension(SOURCE, "batchpage_cpu_layer_ops", "the CPU layer ops", verbose))

    @property
    def raw(self) -> object:
        """The compiled functions, which take the launchers' arguments (outputs first) and
        check nothing: for a caller that checked its shapes once
        (batchpage/ops/compiled_layer_ops.py, at bind).
        add_rms_norm may write its sum over `residual` (each element is read before it is
        written)."""
        return self._module

    def rms_norm(
        self,
        x: torch.Tensor,  # [N, D], rows may be strided
        weight: torch.Tensor,  # [D], x's dtype
        eps: float,
    ) -> torch.Tensor:  # [N, D], contiguous
        _check_rows(x)
        assert weight.shape == x.shape[1:] and weight.dtype == x.dtype and weight.is_contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._module.rms_norm(out, x, weight, eps)
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [N, D], rows may be strided
        residual: torch.Tensor,  # [N, D], rows may be strided
        weight: torch.Tensor,  # [D], x's dtype
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, D] x + residual, [N, D] its RMSNorm)
        _check_rows(x)
        _check_rows(residual)
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert weight.shape == x.shape[1:] and weight.dtype == x.dtype and weight.is_contiguous()
        total = torch.empty(x.shape, dtype=x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._module.add_rms_norm(out, total, x, residual, weight, eps)
        return total, out

    def silu_mul(
        self,
        gate_up: torch.Tensor,  # [N, 2I]: gate in columns [0, I), up in [I, 2I)
    ) -> torch.Tensor:  # [N, I]
        _check_rows(gate_up)
        assert gate_up.shape[1] % 2 == 0, gate_up.shape
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._module.silu_mul(out, gate_up)
        return out

    def rope_(
        self,
        x: torch.Tensor,  # [N, H, D], rows may be strided, heads dense
        cos: torch.Tensor,  # float32 [N, 1, R/2], R the rotary dimension (<= D)
        sin: torch.Tensor,  # float32 [N, 1, R/2]
    ) -> torch.Tensor:  # x, rotated in place
        n, _, dim = x.shape
        assert x.device.type == "cpu" and x.dtype in DTYPES, (x.device, x.dtype)
        assert x.stride(2) == 1 and x.stride(1) == dim, "x's heads must be dense"
        half = cos.shape[-1]
        assert cos.shape == sin.shape == (n, 1, half) and 2 * half <= dim, (cos.shape, x.shape)
        assert cos.dtype == sin.dtype == torch.float32
        self._module.rope(x, cos.reshape(n, half).contiguous(), sin.reshape(n, half).contiguous())
        return x

    def argmax(
        self,
        x: torch.Tensor,  # float32, bf16 or fp16 [N, V], rows may be strided
    ) -> torch.Tensor:  # int64 [N]: torch.argmax(x, dim=-1)
        """Each row's index of its largest value: the first on ties, a NaN's if the row has one
        (torch.argmax's rule), in one pass per row on torch's threads, where torch's argmax over
        a step's logits is one of its slower ops on a CPU. bf16 and fp16 logits
        are read as they are (their float32 values are exact), so a greedy step needs no float32
        copy of its logits."""
        assert x.device.type == "cpu" and x.dtype in DTYPES, (x.device, x.dtype)
        assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0, "rows must be dense"
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._module.argmax_rows(out, x)
        return out

    def race(
        self,
        probs: torch.Tensor,  # float32 [N, V], rows may be strided
        keys: torch.Tensor,  # int64 [N]: each row's 32-bit draw key
    ) -> torch.Tensor:  # int64 [N]
        """Each row's token by the exponential race with counter-based noise: the v maximising
        probs[v] / E(key, v) (batchpage/ops/race.py's exponential_race is the reference, the
        noise its race_noise)."""
        assert probs.device.type == "cpu" and probs.dtype == torch.float32, probs.dtype
        assert probs.dim() == 2 and probs.stride(1) == 1 and probs.shape[1] > 0, "rows: dense"
        assert keys.dtype == torch.int64 and keys.shape == (probs.shape[0],), keys.shape
        out = torch.empty(probs.shape[0], dtype=torch.int64)
        if probs.shape[0]:
            self._module.race_rows(out, probs, keys.contiguous())
        return out
