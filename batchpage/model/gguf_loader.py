"""Load a Llama or Qwen2 GGUF file (llama.cpp format) into LlamaForCausalLM.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized once at load time with `gguf.quants`, so the
engine runs ordinary float weights. llama.cpp's converter reorders the rows of Llama's attn_q and
attn_k from HF's rotate-half layout to interleaved pairs; we undo that here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf.quants import dequantize

from batchpage.model.config import ModelConfig, UnsupportedModelError
from batchpage.model.llama import LlamaForCausalLM

GGUF_MAGIC = b"GGUF"

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows come as (i, half) pairs; HF wants all
    `half = 0` rows, then all `half = 1` rows. w: [n_head * head_dim, ...] (weight or bias)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous row length) first
    ggml_type: int
    offset: int  # bytes from the start of the data section


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict[str, Any]  # scalars and strings as values; arrays as their length
    tensors: list[TensorInfo]
    data_start: int  # file offset of the (aligned) tensor data section


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header with plain struct reads: ~0.2 s for SmolLM2 against ~6 s for
    gguf.GGUFReader, which builds a numpy view for every one of the ~100k vocabulary strings."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
        version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (need 2 or later)")
        meta = {}
        for _ in range(n_kv):
            key = _read_str(f)
            (vtype,) = struct.unpack("<I", f.read(4))
            meta[key] = _read_value(f, vtype)
        tensors = []
        for _ in range(n_tensors):
            name = _read_str(f)
            (n_dims,) = struct.unpack("<I", f.read(4))
            shape = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            ggml_type, offset = struct.unpack("<IQ", f.read(12))
            tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    return GGUFHeader(meta, tensors, data_start)


def gguf_config(header: GGUFHeader) -> ModelConfig:
    names = {t.name for t in header.tensors}
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            "this GGUF stores llama3 rope scaling as a rope_freqs tensor, which batchpage does "
            "not read; use the model's Hugging Face folder instead"
        )
    has_output = "output.weight" in names
    return ModelConfig.from_gguf_metadata(header.meta, has_output)


def read_tensor(data: np.ndarray, header: GGUFHeader, t: TensorInfo) -> torch.Tensor:
    """Dequantize one tensor to float32, shaped torch-style (rows first: [out, in])."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(t.ggml_type)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_len, rows = t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64))
    row_bytes = row_len // block * block_bytes
    start = header.data_start + t.offset
    raw = data[start : start + rows * row_bytes].reshape(rows, row_bytes)
    arr = dequantize(raw, qtype).reshape(tuple(reversed(t.shape)))
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _iter_tensors(
    path: Path, header: GGUFHeader, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        name = gguf_to_hf_name(t.name)
        tensor = read_tensor(data, header, t)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if cfg.model_type == "llama" and kind in ("attn_q", "attn_k"):
            # Only the llama arch is permuted: llama.cpp runs it with interleaved-pair RoPE.
            tensor = unpermute_rows(tensor, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        yield name, tensor


def load_gguf_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    header = read_gguf_header(path)
    cfg = gguf_config(header)
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, max_positions=max_positions)
    model.load_weights(_iter_tensors(path, header, cfg))
    return model.eval(), cfg


# GGUF value types: struct codes of the fixed-width ones; 8 is a string, 9 an array.
_FORMATS = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read_str(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    """A scalar or string value; an array is skipped and returned as its length."""
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _FORMATS:
            f.seek(struct.calcsize(_FORMATS[item_type]) * count, 1)
        else:
            for _ in range(count):
                _read_value(f, item_type)
        return count
    if vtype in _FORMATS:
        fmt = "<" + _FORMATS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    raise ValueError(f"corrupt GGUF header: unknown value type {vtype}")
