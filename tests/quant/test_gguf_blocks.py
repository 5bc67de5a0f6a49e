"""GGUF's quantized blocks decode into IntWeight exactly as the gguf package dequantizes them.

Each case builds one tensor's raw rows of a block type, by the gguf package's own quantizer
where it has one and otherwise (and in every type's second source) as random bytes with
finite float16 scales, so every bit pattern of q, the scales and the mins occurs. The
reference is `gguf.quants.dequantize` (float32, llama.cpp's layouts written independently of
batchpage); the IntWeight, dequantized in float64, must match it to float32 rounding. Each
corruption moves bytes or nibbles of one block the way a wrong layout reading would, and must
make the same comparison fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from batchpage.quant.gguf_blocks import BlockDecoder, decode_q4_0, decode_q4_1, decode_q8_0
from batchpage.quant.gguf_kquants import decode_q4_k, decode_q5_k, decode_q6_k

Corruption = Callable[[np.ndarray], None]  # mutates one block's bytes in place


def _swap_nibbles(start: int, stop: int) -> Corruption:
    def corrupt(block: np.ndarray) -> None:
        part = block[start:stop]
        block[start:stop] = (part << 4) | (part >> 4)

    return corrupt


def _swap_runs(first: int, second: int, size: int) -> Corruption:
    def corrupt(block: np.ndarray) -> None:
        a, b = block[first : first + size].copy(), block[second : second + size].copy()
        block[first : first + size], block[second : second + size] = b, a

    return corrupt


def _reverse(start: int, stop: int) -> Corruption:
    def corrupt(block: np.ndarray) -> None:
        block[start:stop] = block[start:stop][::-1].copy()

    return corrupt


@dataclass(frozen=True)
class BlockType:
    qtype: GGMLQuantizationType
    decoder: BlockDecoder
    values: int  # per block
    nbytes: int  # per block
    halves: tuple[int, ...]  # byte offsets of the block's float16 fields
    bits: int
    group_size: int
    corruptions: dict[str, Corruption]


T = GGMLQuantizationType
TYPES = {
    "q4_0": BlockType(T.Q4_0, decode_q4_0, 32, 18, (0,), 4, 32, {"nibbles": _swap_nibbles(2, 18)}),
    "q4_1": BlockType(
        T.Q4_1, decode_q4_1, 32, 20, (0, 2), 4, 32, {"nibbles": _swap_nibbles(4, 20)}
    ),
    "q8_0": BlockType(T.Q8_0, decode_q8_0, 32, 34, (0,), 8, 32, {"halves": _swap_runs(2, 18, 16)}),
    "q4_k": BlockType(
        T.Q4_K,
        decode_q4_k,
        256,
        144,
        (0, 2),
        4,
        32,
        {
            "nibbles": _swap_nibbles(16, 48),
            "scale_min": _swap_runs(4, 8, 4),
            "runs": _swap_runs(16, 48, 32),
        },
    ),
    "q5_k": BlockType(
        T.Q5_K,
        decode_q5_k,
        256,
        176,
        (0, 2),
        5,
        32,
        {
            "nibbles": _swap_nibbles(48, 80),
            "high_bits": _reverse(16, 48),
            "high_nibble_scales": _swap_nibbles(12, 16),
        },
    ),
    "q6_k": BlockType(
        T.Q6_K,
        decode_q6_k,
        256,
        210,
        (208,),
        6,
        16,
        {
            "nibbles": _swap_nibbles(0, 64),
            "ql_runs": _swap_runs(0, 32, 32),
            "high_bits": _swap_nibbles(128, 160),
            "scales": _reverse(192, 208),
        },
    ),
}
SHAPES = [(n, k) for n in (3, 64) for k in (256, 512, 768)]


def _random_raw(bt: BlockType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, (n, k // bt.values, bt.nbytes), dtype=np.uint8)
    for at in bt.halves:
        half = rng.standard_normal((n, k // bt.values, 1)).astype(np.float16)
        blocks[:, :, at : at + 2] = half.view(np.uint8)
    return blocks.reshape(n, -1)


def _raw(bt: BlockType, n: int, k: int, source: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if source == "quantize":
        w = rng.standard_normal((n, k)).astype(np.float32)
        try:
            return quantize(w, bt.qtype)
        except NotImplementedError:  # the gguf package quantizes no K-quant
            pass
    return _random_raw(bt, n, k, rng)


def _assert_matches(got: torch.Tensor, reference: np.ndarray) -> None:
    ref = torch.from_numpy(reference).double()
    atol = 1e-6 * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("source", ["quantize", "random"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", TYPES)
def test_decode_matches_gguf(name: str, shape: tuple[int, int], source: str) -> None:
    bt, (n, k) = TYPES[name], shape
    raw = _raw(bt, n, k, source, seed=n * k + len(name))
    assert raw.dtype == np.uint8 and raw.shape == (n, k // bt.values * bt.nbytes)
    w = bt.decoder(raw, k)
    assert (w.out_features, w.in_features) == (n, k)
    assert (w.bits, w.group_size, w.perm) == (bt.bits, bt.group_size, None)
    q = w.values()
    assert q.min().item() >= 0 and q.max().item() < 2**bt.bits
    if source == "random" and n * k >= 2**14:  # enough random bytes to reach both ends of q
        assert q.min().item() == 0 and q.max().item() == 2**bt.bits - 1
    _assert_matches(w.dequantize(torch.float64), dequantize(raw, bt.qtype).reshape(n, k))


@pytest.mark.parametrize(
    "name,corruption", [(name, c) for name, bt in TYPES.items() for c in bt.corruptions]
)
def test_corrupted_layout_fails(name: str, corruption: str) -> None:
    bt, n, k = TYPES[name], 3, 512
    raw = _raw(bt, n, k, "random", seed=7)
    reference = dequantize(raw, bt.qtype).reshape(n, k)
    _assert_matches(bt.decoder(raw, k).dequantize(torch.float64), reference)
    bad = raw.copy()
    block = bad.reshape(n, -1, bt.nbytes)[1, 1]  # a view: one block inside the tensor
    bt.corruptions[corruption](block)
    assert not np.array_equal(bad, raw)
    with pytest.raises(AssertionError):
        _assert_matches(bt.decoder(bad, k).dequantize(torch.float64), reference)


@pytest.mark.parametrize("decoder", [decode_q4_k, decode_q5_k, decode_q6_k])
def test_kquant_rows_hold_whole_super_blocks(decoder: BlockDecoder) -> None:
    with pytest.raises(ValueError, match="super-blocks"):
        decoder(np.zeros((2, 210), dtype=np.uint8), 128)
