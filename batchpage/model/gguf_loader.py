"""Load a GGUF file (llama.cpp format) into its family's model.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized once at load time, so the engine runs
ordinary float weights. Tensors are renamed to their HF names, then loaded as the family loads
a HF checkpoint. llama.cpp's converter reorders the rows of the llama arch's attn_q and attn_k
from HF's rotate-half layout to interleaved pairs; we undo that here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import ModelConfig
from batchpage.model.families import build_model
from batchpage.model.gemma_config import GEMMA_FAMILIES, GGUF_BLOCK_NAMES
from batchpage.model.gguf_checks import check_declared_size
from batchpage.model.gguf_config import ROPE_FREQS, gguf_config
from batchpage.model.gguf_file import GGUFHeader, read_gguf_header, read_tensor

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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str, family: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    parts = name.split(".")
    block = {**_BLOCK, **GGUF_BLOCK_NAMES} if family in GEMMA_FAMILIES else _BLOCK
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows come as (i, half) pairs; HF wants all
    `half = 0` rows, then all `half = 1` rows. w: [n_head * head_dim, ...] (weight or bias)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _iter_tensors(
    path: Path, header: GGUFHeader, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        if t.name == ROPE_FREQS:
            continue  # already in cfg.rope_scaling
        name = gguf_to_hf_name(t.name, cfg.family)
        tensor = read_tensor(data, header, t)
        if cfg.family in GEMMA_FAMILIES and t.name.endswith("norm.weight"):
            tensor = tensor - 1  # llama.cpp stores Gemma's norm weights with its 1 + added
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if cfg.model_type == "llama" and kind in ("attn_q", "attn_k"):
            # Only the llama arch is permuted: llama.cpp runs it with interleaved-pair RoPE.
            heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
            if tensor.shape[0] != heads * cfg.head_dim:  # else the reshape fails without a name
                raise ValueError(
                    f"{path}: tensor {t.name!r} has {tensor.shape[0]} rows, expected "
                    f"{heads} heads x {cfg.head_dim}: download or convert the file again"
                )
            tensor = unpermute_rows(tensor, heads)
        yield name, tensor


def load_gguf_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
) -> tuple[CausalLM, ModelConfig]:
    header = read_gguf_header(path)
    cfg = gguf_config(path, header)
    check_declared_size(path, header, cfg)  # before sizes from the header allocate memory
    model = build_model(cfg, dtype, device, max_positions)
    model.load_weights(_iter_tensors(path, header, cfg))
    return model.eval(), cfg
