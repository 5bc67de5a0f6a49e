"""Hostile GGUF files for the tests: a tiny valid model written by gguf's own GGUFWriter,
byte-level edits of it, and one load that either succeeds or refuses the file with batchpage's
own one-line error.

The reliability benchmark fuzzes with these (jobs/gguf_fuzz.py imports them and adds its seeded
random edits): tests do not import jobs/.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

import batchpage

# Values a hostile or damaged file tends to hold where a count, length, type or size is read.
INTERESTING = (0, 1, 2, 3, 8, 9, 12, 13, 31, 33, 255, 2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 1,
               4_000_000_000, 2**40, 2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip
MUTATIONS = ("truncate", "byte", "u32", "u64", "insert", "delete")
TINY_SIZES = dict(
    block_count=2, context_length=128, embedding_length=32, feed_forward_length=64,
    attention__head_count=4, attention__head_count_kv=2, vocab_size=64,
)  # fmt: skip
_BATCHPAGE = str(Path(batchpage.__file__).parent)


def tiny_gguf(
    path: Path, sizes: dict[str, int] | None = None, int8: tuple[str, ...] = (), seed: int = 0
) -> Path:
    """A 2-layer llama GGUF with random weights in F32, F16, Q8_0 and Q4_1, a string vocabulary
    and a nested array, as llama.cpp's converter lays one out. `sizes` overrides the size keys
    (`attention__head_count` is attention.head_count); tensors named in `int8` are stored as I8,
    a type batchpage cannot dequantize."""
    keys = {**TINY_SIZES, **(sizes or {})}
    hidden, ffn, vocab, kv = 32, 64, 64, 16
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        w.add_uint32(f"llama.{key.replace('__', '.')}", value)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_array("general.tags", [["a", "b"], ["c"]])  # an array of arrays: nesting is legal
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,), "output": (vocab, hidden)}
    for i in range(2):
        shapes |= {
            f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.attn_q": (hidden, hidden),
            f"blk.{i}.attn_k": (kv, hidden), f"blk.{i}.attn_v": (kv, hidden),
            f"blk.{i}.attn_output": (hidden, hidden), f"blk.{i}.ffn_norm": (hidden,),
            f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
            f"blk.{i}.ffn_down": (hidden, ffn),
        }  # fmt: skip
    kinds = ("Q8_0", "Q4_1", "F16", "F32")
    for n, (name, shape) in enumerate(shapes.items()):
        if name in int8:
            w.add_tensor(f"{name}.weight", np.zeros(shape, dtype=np.int8))
            continue
        qtype = gguf.GGMLQuantizationType["F32" if len(shape) == 1 else kinds[n % 4]]
        values = rng.normal(0.0, 0.1, size=shape).astype(np.float32)
        w.add_tensor(f"{name}.weight", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mutate(data: bytes, op: str, pos: int, value: int) -> bytes:
    """One edit at byte `pos` (taken modulo the length): cut the file there, set one byte,
    write `value` as a little-endian u32 or u64, insert 1-8 copies of a byte, or delete 1-8
    bytes."""
    if not data:
        return data
    pos %= len(data)
    if op == "truncate":
        return data[:pos]
    if op == "byte":
        return data[:pos] + bytes([value & 0xFF]) + data[pos + 1 :]
    if op in ("u32", "u64"):
        bits = 32 if op == "u32" else 64
        packed = struct.pack("<I" if bits == 32 else "<Q", value % 2**bits)
        return data[:pos] + packed + data[pos + len(packed) :]
    if op == "insert":
        return data[:pos] + bytes([value & 0xFF]) * (1 + value % 8) + data[pos:]
    if op == "delete":
        return data[:pos] + data[pos + 1 + value % 8 :]
    raise ValueError(f"unknown mutation {op!r}; use one of {', '.join(MUTATIONS)}")


def load_outcome(path: Path) -> str:
    """The outcome: "loaded", or the name of the error batchpage refused the file with.
    Anything else (an error of another type, or one raised outside batchpage such as numpy's
    "cannot reshape", or one whose message spans lines) propagates: that is a crash."""
    from batchpage.model.gguf_loader import load_gguf_model
    from batchpage.model.loader import resolve_model_source

    try:
        resolve_model_source(str(path))
        load_gguf_model(path, torch.float32, "cpu", max_positions=64)
    except ValueError as e:
        if not (_raised_in_batchpage(e) and "\n" not in str(e)):
            raise
        return type(e).__name__
    return "loaded"


def _raised_in_batchpage(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_BATCHPAGE)
