"""Quantized checkpoints written the way each format's own writer writes them, for the tests.

Each packer takes a float weight [N, K], quantizes it (min-max per group, scales rounded to
float16 as the writers store them) and returns the format's tensors together with the
dequantized weight they stand for, which the tests hand to HF transformers as the reference.
The packing follows each format's published layout (AutoGPTQ's and AutoAWQ's pack loops;
compressed-tensors' own `pack_to_int32`), written here independently of batchpage's decoders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [N, K], unsigned
    scale: torch.Tensor  # float32 [N, G], float16-exact
    zero: torch.Tensor  # int64 [N, G]
    groups: torch.Tensor  # int64 [K]: the group of each input
    dense: torch.Tensor  # float32 [N, K]: scale * (q - zero)


def quantize(
    w: torch.Tensor, bits: int, group: int | None, sym: bool, act_order: bool = False, seed: int = 0
) -> Quantized:
    n, k = w.shape
    group = group or k
    if act_order:  # GPTQ's desc_act: inputs visited in a permuted order, grouped in that order
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        groups = torch.empty(k, dtype=torch.int64)
        groups[perm] = torch.arange(k) // group
    else:
        groups = torch.arange(k) // group
    g_count = int(groups.max()) + 1
    top = (1 << bits) - 1
    scale = torch.empty(n, g_count)
    zero = torch.empty(n, g_count, dtype=torch.int64)
    for g in range(g_count):
        cols = w[:, groups == g]
        if sym:
            s = cols.abs().amax(1).clamp_min(1e-4) / ((top + 1) // 2 - 0.5)
            z = torch.full((n,), (top + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp_min(1e-4)
            z = torch.round(-lo / s.half().float()).long().clamp(0, top)
        scale[:, g], zero[:, g] = s.half().float(), z
    q = torch.round(w / scale[:, groups]) + zero[:, groups]
    q = q.clamp(0, top).long()
    dense = scale[:, groups] * (q - zero[:, groups]).float()
    return Quantized(q, scale, zero, groups, dense)


def pack_words(
    values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """int [R, C] unsigned -> int32 [R, C * bits / 32]: value i of each word at bits [bits * i,
    bits * (i + 1)), taken from column order[i] of the word's run (in order when None)."""
    per = 32 // bits
    r, c = values.shape
    runs = values.reshape(r, c // per, per).long()
    if order is not None:
        runs = runs[:, :, list(order)]
    word = torch.zeros(r, c // per, dtype=torch.int64)
    for i in range(per):
        word |= runs[:, :, i] << (bits * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # the word's bits, as a signed int32


def gptq_tensors(qz: Quantized, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: qweight along K, qzeros along N (minus one in v1)."""
    zeros = qz.zero.t()  # [G, N]
    if v1:
        zeros = (zeros - 1) & ((1 << bits) - 1)
    return {
        "qweight": pack_words(qz.q, bits).t().contiguous(),  # [K * bits / 32, N]
        "qzeros": pack_words(zeros.contiguous(), bits),
        "scales": qz.scale.t().contiguous().half(),
        "g_idx": qz.groups.to(torch.int32),
    }


def awq_tensors(qz: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear: qweight [K, N / 8] and qzeros [G, N / 8] along N
    in AWQ's interleaved order."""
    return {
        "qweight": pack_words(qz.q.t().contiguous(), 4, AWQ_ORDER),
        "qzeros": pack_words(qz.zero.t().contiguous(), 4, AWQ_ORDER),
        "scales": qz.scale.t().contiguous().half(),
    }


def compressed_tensors(qz: Quantized, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized: values in their signed range, packed by the
    library's own pack_to_int32 (which adds 2^(bits - 1) back)."""
    half = 1 << (bits - 1)
    out = {
        "weight_packed": pack_to_int32((qz.q - half).to(torch.int8), bits),
        "weight_scale": qz.scale.half(),
        "weight_shape": torch.tensor(list(qz.q.shape)),
    }
    if not sym:
        out["weight_zero_point"] = pack_to_int32(
            (qz.zero - half).to(torch.int8), bits, packed_dim=0
        )
    return out


def compressed_int8(qz: Quantized) -> dict[str, torch.Tensor]:
    """compressed-tensors' int-quantized (W8A8): the signed int8 weight as it is, with its
    per-channel scale."""
    return {"weight": (qz.q - 128).to(torch.int8), "weight_scale": qz.scale.half()}


@dataclass
class Fp8Quantized:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [ceil(N / R), ceil(K / C)]: one per block
    dense: torch.Tensor  # float32 [N, K]: weight * its block's scale


def quantize_fp8(w: torch.Tensor, block: tuple[int, int | None] | None) -> Fp8Quantized:
    """FP8 e4m3 with one scale per block of R rows by C inputs (C None: the whole row; block
    None: one scale for the tensor), the
    block's max |w| mapped to about e4m3's largest value, 448; torch's own float8_e4m3fn
    rounding."""
    n, k = w.shape
    rows, cols = block or (n, k)
    cols = cols or k
    scale = torch.empty(-(-n // rows), -(-k // cols))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            scale[i, j] = part.abs().max().clamp_min(1e-8) / 448
    # bf16-exact scales, so that each product (4 by 8 significant bits) is exact in float32
    scale = scale.bfloat16().float()
    full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    weight = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8Quantized(weight, scale, weight.float() * full)


def fp8_block(qz: Fp8Quantized) -> dict[str, torch.Tensor]:
    """HF's fp8 with weight_block_size: the scale of each block as weight_scale_inv."""
    return {"weight": qz.weight, "weight_scale_inv": qz.scale}


def fp8_tensor_static(qz: Fp8Quantized) -> dict[str, torch.Tensor]:
    """HF's fp8 per tensor, static activations: one weight_scale and one input_scale."""
    return {
        "weight": qz.weight,
        "weight_scale": qz.scale.reshape(()).clone(),
        "input_scale": torch.tensor(0.02),  # unused: activations run in the model's dtype
    }


def ct_fp8(qz: Fp8Quantized) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized: weight_scale [N, 1] per channel, else per block."""
    return {"weight": qz.weight, "weight_scale": qz.scale}


def quantize_linear_inputs(model: torch.nn.Module, suffixes: tuple[str, ...]) -> None:
    """Make an HF model's linears (those whose names end in `suffixes`) see their inputs as
    W8A8 does: each token's row rounded to a multiple of its own max |x| / 127. A plain-torch
    reference of dynamic per-token activation quantization, independent of batchpage's."""

    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        (x,) = args
        step = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
        return (torch.round(x / step).clamp(-128, 127) * step,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(suffixes):
            module.register_forward_pre_hook(hook)
