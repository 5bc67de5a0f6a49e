"""Load a GGUF file (llama.cpp format) into its family's model.

The linears' quantized tensors (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) stay quantized:
decoded into IntWeight (batchpage/quant/gguf_blocks.py, gguf_kquants.py), they load as a GPTQ
checkpoint's do, and the engine's linear method makes each one's module at bind (an int kernel, or
the layer dequantized once). Everything else (embeddings, norms, other types, and a row-parallel
linear whose tensor-parallel share is not whole blocks) is dequantized at load. Tensors are renamed
to their HF names, then loaded as the family loads a HF checkpoint. llama.cpp's converter reorders
the rows of the llama arch's attn_q and attn_k from HF's rotate-half layout to interleaved pairs; we
undo that here.
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
from batchpage.model.gguf_file import (
    GGUFHeader,
    TensorInfo,
    read_gguf_header,
    read_raw_rows,
    read_tensor,
)
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.model.quant_layout import quantize_layout, whole_linears
from batchpage.model.shard import TensorShard
from batchpage.ops.linear_method import LinearSpec
from batchpage.quant.gguf_types import GGUF_INT_TYPES
from batchpage.quant.int_weight import IntWeight, as_form
from batchpage.quant.scheme import QuantScheme

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


# The GGUF tensors that are linears' weights (token_embd is an embedding, kept dense).
_LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


def _is_linear(t: TensorInfo) -> bool:
    parts = t.name.split(".")
    kind = parts[2] if len(parts) == 4 and parts[0] == "blk" else t.name
    return parts[-1] == "weight" and (kind in _LINEARS or t.name == "output.weight")


def int_schemes(header: GGUFHeader, cfg: ModelConfig) -> dict[str, QuantScheme]:
    """HF prefix (without `model.`) -> the scheme of each linear the file stores in a type the
    integer kernels run."""
    schemes = {}
    for t in header.tensors:
        form = GGUF_INT_TYPES.get(t.ggml_type)
        if form is None or not _is_linear(t):
            continue
        prefix = gguf_to_hf_name(t.name, cfg.family).removeprefix("model.").removesuffix(".weight")
        schemes[prefix] = QuantScheme(
            "gguf", form.bits, form.group_size, symmetric=False, act_order=False, label=form.name
        )
    return schemes


def _rows_to_hf(path: Path, t: TensorInfo, cfg: ModelConfig, rows: int) -> torch.Tensor | None:
    """The row order HF wants, for the llama arch's attn_q and attn_k (None: keep it)."""
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if cfg.model_type != "llama" or kind not in ("attn_q", "attn_k"):
        return None
    # Only the llama arch is permuted: llama.cpp runs it with interleaved-pair RoPE.
    heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
    if rows != heads * cfg.head_dim:  # else the reshape fails without a name
        raise ValueError(
            f"{path}: tensor {t.name!r} has {rows} rows, expected "
            f"{heads} heads x {cfg.head_dim}: download or convert the file again"
        )
    return unpermute_rows(torch.arange(rows), heads)


def _int_weight(
    data: np.ndarray, header: GGUFHeader, t: TensorInfo, scheme: QuantScheme
) -> IntWeight:
    form = GGUF_INT_TYPES[t.ggml_type]
    weight = form.decode(read_raw_rows(data, header, t), t.shape[0])
    return as_form(weight, scheme.bits, scheme.group_size or weight.group_size)


def _iter_tensors(
    path: Path, header: GGUFHeader, cfg: ModelConfig, held: dict[str, QuantScheme]
) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        if t.name == ROPE_FREQS:
            continue  # already in cfg.rope_scaling
        name = gguf_to_hf_name(t.name, cfg.family)
        prefix = name.removeprefix("model.").removesuffix(".weight")
        if prefix == "embed_tokens" and "tied_quant" in held:  # the tied head's table too
            weight = _int_weight(data, header, t, held["tied_quant"])
            for leaf in ("packed", "scales", "offsets"):
                yield f"tied_quant.{leaf}", getattr(weight, leaf)
        if prefix in held:
            weight = _int_weight(data, header, t, held[prefix])
            order = _rows_to_hf(path, t, cfg, weight.out_features)
            for leaf in ("packed", "scales", "offsets"):
                tensor = getattr(weight, leaf)
                yield f"{prefix}.{leaf}", tensor if order is None else tensor[order]
            continue
        tensor = read_tensor(data, header, t)
        if cfg.family in GEMMA_FAMILIES and t.name.endswith("norm.weight"):
            tensor = tensor - 1  # llama.cpp stores Gemma's norm weights with its 1 + added
        order = _rows_to_hf(path, t, cfg, tensor.shape[0])
        yield name, tensor if order is None else tensor[order]


def load_gguf_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    shard: TensorShard | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The model (with `shard`, one tensor-parallel rank's share: its tensors decoded to
    IntWeight's row-major layout are cut as dense ones are) and the file's whole config."""
    header = read_gguf_header(path)
    cfg = gguf_config(path, header)
    check_declared_size(path, header, cfg)  # before sizes from the header allocate memory
    model = build_model(cfg, dtype, device, max_positions, shard)
    held = quantize_layout(model, whole_linears(model, int_schemes(header, cfg))).held
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    form = None if embed is None else GGUF_INT_TYPES.get(embed.ggml_type)
    if cfg.tie_word_embeddings and form is not None:
        scheme = QuantScheme(
            "gguf", form.bits, form.group_size, symmetric=False, act_order=False, label=form.name
        )
        rows = cfg.vocab_size if shard is None else shard.vocab_rows(cfg.vocab_size)
        spec = LinearSpec(cfg.hidden_size, (rows,), False, dtype, scheme, reads_rows=True)
        model.tied_quant = LoadedLinear(spec, device)
        held["tied_quant"] = scheme
    model.load_weights(_iter_tensors(path, header, cfg, held))
    return model.eval(), cfg
