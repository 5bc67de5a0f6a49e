"""The GGUF types batchpage holds as integers, and how: a ggml type id -> its name, the bits
and group of the IntWeight its decoder makes."""

from __future__ import annotations

from typing import NamedTuple

from gguf import GGMLQuantizationType as T

from batchpage.quant.gguf_blocks import BlockDecoder, decode_q4_0, decode_q4_1, decode_q8_0
from batchpage.quant.gguf_kquants import decode_q4_k, decode_q5_k, decode_q6_k


class GgufIntType(NamedTuple):
    name: str  # the format's name in stats
    bits: int
    group_size: int
    decode: BlockDecoder


GGUF_INT_TYPES: dict[int, GgufIntType] = {
    T.Q4_0: GgufIntType("q4_0", 4, 32, decode_q4_0),
    T.Q4_1: GgufIntType("q4_1", 4, 32, decode_q4_1),
    T.Q8_0: GgufIntType("q8_0", 8, 32, decode_q8_0),
    T.Q4_K: GgufIntType("q4_k", 4, 32, decode_q4_k),
    T.Q5_K: GgufIntType("q5_k", 5, 32, decode_q5_k),
    T.Q6_K: GgufIntType("q6_k", 6, 16, decode_q6_k),
}
