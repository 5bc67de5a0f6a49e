"""GGUF's quantized block types -> IntWeight, without dequantizing.

A GGUF tensor of N rows of K values is N * K / B blocks of B values each (rows first, each
row's blocks in order); a block holds its float16 scale (and offset) and the packed values.
The decoders turn them into IntWeight's form (int_weight.py: one group per block or
sub-block), so a GGUF file runs through the same integer kernels as AWQ or GPTQ. Layouts as
llama.cpp's ggml-common.h defines them:
- Q4_0 (18 bytes / 32 values): d f16, qs[16]; value j < 16 is qs[j]'s low nibble, value
  j + 16 its high one; W = d * (q - 8).
- Q4_1 (20 bytes / 32): d f16, m f16, qs[16] as Q4_0; W = d * q + m.
- Q8_0 (34 bytes / 32): d f16, qs int8[32]; W = d * q.
The K-quants (Q4_K, Q5_K, Q6_K) are in gguf_kquants.py; the table of both, gguf_types.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchpage.quant.int_weight import IntWeight

# raw uint8 [N, row bytes], K -> IntWeight
BlockDecoder = Callable[[np.ndarray, int], IntWeight]


def _f16(raw: np.ndarray, at: int) -> torch.Tensor:  # [N, blocks, bytes] -> f32 [N, blocks]
    halves = np.ascontiguousarray(raw[:, :, at : at + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(halves).float()


def _blocks(raw: np.ndarray, k: int, block_bytes: int) -> np.ndarray:
    n = raw.shape[0]
    return np.asarray(raw).reshape(n, k // 32, block_bytes)


def _nibble_values(qs: np.ndarray) -> torch.Tensor:  # uint8 [N, blocks, 16] -> [N, blocks * 32]
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(q.shape[0], -1)


def _repack_nibbles(qs: np.ndarray) -> torch.Tensor:  # uint8 [N, blocks, 16] -> [N, blocks * 16]
    """A block's 16 bytes (value j < 16 in byte j's low nibble, j + 16 in its high one) in
    IntWeight's packing (values 2i and 2i + 1 in byte i's low and high nibbles), byte pairs
    recombined without unpacking every value: bytes a = qs[2i], b = qs[2i + 1] give byte i
    (a & 0xF) | (b << 4) and byte i + 8 (a >> 4) | (b & 0xF0)."""
    even, odd = qs[:, :, 0::2], qs[:, :, 1::2]
    low = (even & 0x0F) | (odd << 4)
    high = (even >> 4) | (odd & 0xF0)
    return torch.from_numpy(np.concatenate([low, high], axis=2).reshape(qs.shape[0], -1))


def decode_q4_0(raw: np.ndarray, k: int) -> IntWeight:
    b = _blocks(raw, k, 18)
    d = _f16(b, 0)
    return IntWeight(_repack_nibbles(b[:, :, 2:]), d, -8 * d, 4, 32, k)


def decode_q4_1(raw: np.ndarray, k: int) -> IntWeight:
    b = _blocks(raw, k, 20)
    return IntWeight(_repack_nibbles(b[:, :, 4:]), _f16(b, 0), _f16(b, 2), 4, 32, k)


def decode_q8_0(raw: np.ndarray, k: int) -> IntWeight:
    b = _blocks(raw, k, 34)
    d = _f16(b, 0)
    q = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).view(np.int8)).to(torch.int16) + 128
    return IntWeight(q.to(torch.uint8).reshape(b.shape[0], k), d, -128 * d, 8, 32, k)
