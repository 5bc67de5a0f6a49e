"""Reading a GGUF file (llama.cpp format): the header with plain struct reads, and one tensor
at a time, dequantized with `gguf.quants`.

The header is untrusted input. Every count and length is checked against the bytes left in the
file before anything is read or allocated, array nesting is bounded, the alignment must be a
power of two, and every tensor must have a known type and sane dimensions and lie inside the
file without overlapping another. So a truncated or hostile file is one CorruptGGUFError that
names the fault, never a struct error, a huge allocation or a deep recursion.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from batchpage.model.config import UnsupportedModelError

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp's tensors have at most four dimensions
MAX_ARRAY_NESTING = 4  # arrays of arrays of ...; real files nest at most once
_FIX = "download or convert the file again"


class CorruptGGUFError(ValueError):
    """The file is not a well-formed GGUF: truncated, damaged or hostile. Its message is one
    line naming the file and the fault."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous row length) first
    ggml_type: int
    offset: int  # bytes from the start of the data section
    nbytes: int  # size of its data in the file


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict[str, Any]  # scalars and strings as values; arrays as their length
    tensors: list[TensorInfo]
    data_start: int  # file offset of the (aligned) tensor data section
    path: Path
    file_size: int


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and validate the header in one pass over its bytes, where gguf.GGUFReader builds
    a numpy view for every vocabulary string (a large vocabulary makes that the slow part of a
    load)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 4 or f.seek(0) != 0 or f.read(4) != GGUF_MAGIC:
            raise CorruptGGUFError(f"{path} is not a GGUF file (bad magic bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _HeaderParser(path, buf, size).parse()


def read_raw_rows(data: np.ndarray, header: GGUFHeader, t: TensorInfo) -> np.ndarray:
    """One tensor's bytes, uint8 [rows, bytes per row] (a row: ne0 values in its blocks)."""
    qtype = GGMLQuantizationType(t.ggml_type)  # checked against GGML_QUANT_SIZES in the header
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_len, rows = t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64))
    start = header.data_start + t.offset
    if start + t.nbytes > data.size:  # the header was checked against a longer file
        raise CorruptGGUFError(
            f"{header.path}: tensor {_shown(t.name)} ends at byte {start + t.nbytes:,} but the "
            f"file has {data.size:,}: was it replaced while loading? {_FIX}"
        )
    return data[start : start + t.nbytes].reshape(rows, row_len // block * block_bytes)


def read_tensor(data: np.ndarray, header: GGUFHeader, t: TensorInfo) -> torch.Tensor:
    """Dequantize one tensor to float32, shaped torch-style (rows first: [out, in])."""
    qtype = GGMLQuantizationType(t.ggml_type)
    raw = read_raw_rows(data, header, t)
    try:
        arr = dequantize(raw, qtype).reshape(tuple(reversed(t.shape)))
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{header.path.name}: tensor {_shown(t.name)} is stored as {qtype.name}, which "
            "batchpage cannot dequantize: use another quantization of the model (F16, Q8_0, ...)"
        ) from None
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def read_named_tensor(path: Path, header: GGUFHeader, name: str) -> torch.Tensor:
    """One tensor by name (for small ones the config needs, such as rope_freqs)."""
    info = next(t for t in header.tensors if t.name == name)
    return read_tensor(np.memmap(path, dtype=np.uint8, mode="r"), header, info)


# GGUF value types: struct codes of the fixed-width ones; 8 is a string, 9 an array.
_FORMATS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Fewest bytes an item of each type takes: bounds a count by the bytes left before looping.
_MIN_BYTES = {t: struct.calcsize(f) for t, f in _FORMATS.items()} | {_STRING: 8, _ARRAY: 12}
_U64 = struct.Struct("<Q")
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


class _HeaderParser:
    """One pass over the header, each read bounded by the bytes left in the file."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 4

    def fail(self, problem: str) -> CorruptGGUFError:
        return CorruptGGUFError(f"{self.path}: corrupt or truncated GGUF header: {problem}; {_FIX}")

    def parse(self) -> GGUFHeader:
        (version,) = self.unpack("<I", "the version")
        if version not in (2, 3):
            why = "is too old (need 2 or later)" if version < 2 else "is unknown (2 and 3 are)"
            raise self.fail(f"GGUF version {version} {why}")
        n_tensors, n_kv = self.unpack("<QQ", "the tensor and key counts")
        self.check_count(n_kv, _MIN_KV_BYTES, "metadata keys")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string("a metadata key")
            if key in meta:
                raise self.fail(f"metadata key {_shown(key)} appears twice")
            (vtype,) = self.unpack("<I", f"the type of {_shown(key)}")
            meta[key] = self.value(vtype, key, 0)
        self.check_count(n_tensors, _MIN_TENSOR_BYTES, "tensors")
        tensors = [self.tensor_info() for _ in range(n_tensors)]
        align = meta.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise self.fail(f"general.alignment is {align!r}: it must be a power of two")
        data_start = -(-self.pos // align) * align
        self.check_tensor_data(tensors, data_start, align)
        return GGUFHeader(meta, tensors, data_start, self.path, self.size)

    def take(self, n: int, what: str) -> int:
        """Advance past n bytes; returns where they start."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(
                f"{what} needs {n:,} bytes at offset {start:,} but the file ends at {self.size:,}"
            )
        self.pos = start + n
        return start

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))

    def check_count(self, count: int, min_bytes: int, what: str) -> None:
        if count * min_bytes > self.size - self.pos:
            raise self.fail(
                f"{count:,} {what} cannot fit in the {self.size - self.pos:,} bytes left"
            )

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        start = self.take(n, what)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str, depth: int) -> Any:
        """A scalar or string value; an array is skipped and returned as its length."""
        if vtype == _STRING:
            return self.string(f"the value of {_shown(key)}")
        if vtype == _ARRAY:
            item_type, count = self.unpack("<IQ", f"the array {_shown(key)}")
            if item_type not in _MIN_BYTES:
                raise self.fail(f"array {_shown(key)} has unknown item type {item_type}")
            if item_type == _ARRAY and depth + 1 >= MAX_ARRAY_NESTING:
                raise self.fail(f"array {_shown(key)} nests more than {MAX_ARRAY_NESTING} deep")
            self.check_count(count, _MIN_BYTES[item_type], f"items of array {_shown(key)}")
            if item_type in _FORMATS:
                self.take(_MIN_BYTES[item_type] * count, f"the array {_shown(key)}")
            elif item_type == _STRING:
                self.skip_strings(count, key)
            else:
                for _ in range(count):
                    self.value(item_type, key, depth + 1)
            return count
        if vtype in _FORMATS:
            return self.unpack("<" + _FORMATS[vtype], f"the value of {_shown(key)}")[0]
        raise self.fail(f"key {_shown(key)} has unknown value type {vtype}")

    def skip_strings(self, count: int, key: str) -> None:
        """Step over `count` strings without decoding them: the vocabulary is ~100k of them,
        so this loop is the header's hot path."""
        length, pos, size, buf = _U64.unpack_from, self.pos, self.size, self.buf
        for _ in range(count):
            if pos + 8 > size:
                break
            pos += 8 + length(buf, pos)[0]
            if pos > size:
                break
        else:
            self.pos = pos
            return
        raise self.fail(
            f"a string in array {_shown(key)} runs past the end of the file ({size:,} bytes)"
        )

    def tensor_info(self) -> TensorInfo:
        name = self.string("a tensor name")
        (n_dims,) = self.unpack("<I", f"the dimensions of tensor {_shown(name)}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(
                f"tensor {_shown(name)} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )
        shape = self.unpack(f"<{n_dims}Q", f"the shape of tensor {_shown(name)}")
        ggml_type, offset = self.unpack("<IQ", f"the type of tensor {_shown(name)}")
        if min(shape) < 1:
            raise self.fail(
                f"tensor {_shown(name)} has shape {list(shape)}: sizes must be positive"
            )
        sizes = {int(t): s for t, s in GGML_QUANT_SIZES.items()}
        if ggml_type not in sizes:
            raise self.fail(f"tensor {_shown(name)} has unknown type {ggml_type}")
        block, block_bytes = sizes[ggml_type]
        if shape[0] % block:
            raise self.fail(
                f"tensor {_shown(name)} has rows of {shape[0]} values, not a multiple of its "
                f"{GGMLQuantizationType(ggml_type).name} block of {block}"
            )
        nbytes = int(np.prod(shape, dtype=object)) // block * block_bytes
        return TensorInfo(name, tuple(shape), ggml_type, offset, nbytes)

    def check_tensor_data(self, tensors: list[TensorInfo], data_start: int, align: int) -> None:
        """Each tensor inside the file, aligned, and not sharing bytes with another (which
        would let a small file declare an unbounded model)."""
        if len({t.name for t in tensors}) != len(tensors):
            seen: set[str] = set()
            twice = next(t.name for t in tensors if t.name in seen or seen.add(t.name))
            raise self.fail(f"tensor {_shown(twice)} appears twice")
        end_of_previous, previous = 0, ""
        for t in sorted(tensors, key=lambda t: t.offset):
            if t.offset % align:
                raise self.fail(
                    f"tensor {_shown(t.name)} at offset {t.offset} is not {align}-aligned"
                )
            if data_start + t.offset + t.nbytes > self.size:
                raise self.fail(
                    f"tensor {_shown(t.name)} ({t.nbytes:,} bytes at data offset {t.offset:,}) "
                    f"ends past the end of the file ({self.size:,} bytes)"
                )
            if t.offset < end_of_previous:
                raise self.fail(f"tensors {_shown(previous)} and {_shown(t.name)} overlap")
            end_of_previous, previous = t.offset + t.nbytes, t.name


def _shown(name: str) -> str:
    """A key or tensor name for a message: quoted, escaped, and short (a damaged length can
    make a 'name' of megabytes)."""
    text = repr(name)
    return text if len(text) <= 60 else text[:56] + "...'"
