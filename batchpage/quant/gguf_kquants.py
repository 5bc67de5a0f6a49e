"""GGUF's K-quants (Q4_K, Q5_K, Q6_K) -> IntWeight, without dequantizing.

A K-quant groups 256 values into a super-block whose float16 scale d (and dmin) multiplies
small integer per-sub-block scales (and mins); IntWeight gets one group per sub-block, its
scale d * sc_j (and offset -dmin * m_j) formed in float32, where the product of a float16 and
an integer below 2^8 is exact. Layouts as llama.cpp's ggml-common.h defines them:
- Q4_K (144 bytes / 256 values): d f16, dmin f16, scales[12], qs[128]. Eight sub-blocks of
  32, each a 6-bit scale sc_j and a 6-bit min m_j: for j < 4, sc_j and m_j are the low six
  bits of scales[j] and scales[j + 4]; for j >= 4 their low nibbles are scales[j + 4]'s low
  and high nibble, their top two bits the top two bits of scales[j - 4] and scales[j]. Each
  64 values use 32 bytes of qs: the first 32 values are their low nibbles, the next 32 their
  high ones. W = d * sc_j * q - dmin * m_j.
- Q5_K (176 bytes / 256): d, dmin, scales[12] as Q4_K, qh[32], qs[128] as Q4_K; value l of
  sub-block j takes bit j of qh[l] as its fifth bit.
- Q6_K (210 bytes / 256): ql[128], qh[64], scales int8[16] (one per 16 values), d f16. Each
  128 values use 64 bytes of ql and 32 of qh: their low nibbles are ql's low nibbles then
  its high ones, value 32 * c + l takes bits 2c, 2c + 1 of qh[l] as its top two.
  W = d * sc_j * (q - 32).
"""

from __future__ import annotations

import numpy as np
import torch

from batchpage.quant.gguf_blocks import _f16, _nibble_values
from batchpage.quant.int_weight import IntWeight, pack_nibbles

SUPER_BLOCK = 256


def _superblocks(raw: np.ndarray, k: int, block_bytes: int) -> np.ndarray:
    if k % SUPER_BLOCK:
        raise ValueError(f"a K-quant row holds whole super-blocks of 256 values, not {k}")
    n = raw.shape[0]
    return np.asarray(raw).reshape(n, k // SUPER_BLOCK, block_bytes)


def _bytes(b: np.ndarray, start: int, stop: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b[:, :, start:stop]))


def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, S, 12] -> the 6-bit scales and mins, float32 [N, S, 8] each."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 0x3F, (high & 0xF) | ((low >> 6) << 4)], dim=2)
    m = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 6) << 4)], dim=2)
    return sc.float(), m.float()


def _groups(d: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:  # [N, S], [N, S, J]
    return (d.unsqueeze(2) * per_group).reshape(d.shape[0], -1)


def _low_nibbles(qs: np.ndarray, run: int) -> torch.Tensor:  # uint8 [N, S, B] -> [N, S * 2B]
    """Each `run` bytes hold 2 * run values: their low nibbles, then their high ones."""
    return _nibble_values(qs.reshape(qs.shape[0], -1, run))


def _k4_scales(b: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = _scale_min(_bytes(b, 4, 16))
    return _groups(_f16(b, 0), sc), -_groups(_f16(b, 2), m)


def decode_q4_k(raw: np.ndarray, k: int) -> IntWeight:
    b = _superblocks(raw, k, 144)
    scales, offsets = _k4_scales(b)
    q = _low_nibbles(b[:, :, 16:144], 32)
    return IntWeight(pack_nibbles(q), scales, offsets, 4, 32, k)


def decode_q5_k(raw: np.ndarray, k: int) -> IntWeight:
    b = _superblocks(raw, k, 176)
    scales, offsets = _k4_scales(b)
    low = _low_nibbles(b[:, :, 48:176], 32)
    qh = _bytes(b, 16, 48)  # [N, S, 32]
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 1).reshape(b.shape[0], k)
    return IntWeight(low | (high << 4), scales, offsets, 5, 32, k)


def decode_q6_k(raw: np.ndarray, k: int) -> IntWeight:
    b = _superblocks(raw, k, 210)
    n = b.shape[0]
    low = _low_nibbles(b[:, :, 0:128], 64)
    qh = _bytes(b, 128, 192).reshape(n, -1, 1, 32)  # one row of 32 per 128 values
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, k)
    sc = torch.from_numpy(np.ascontiguousarray(b[:, :, 192:208]).view(np.int8)).float()
    scales = _groups(_f16(b, 208), sc)
    return IntWeight(low | (high << 4), scales, -32 * scales, 6, 16, k)
