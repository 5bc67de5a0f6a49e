"""Give a freshly built model the quantized linears its checkpoint holds, before it loads.

The model is built as for a float checkpoint; each dense linear the checkpoint stores quantized
is then replaced by a QuantLinear of the same shape, so that `load_weights` fills IntWeight
tensors by the same names and shard keys as dense ones. A merged linear (q/k/v, gate/up) is
quantized when all its checkpoint parts are; a checkpoint that quantizes some parts of one and
not others, or quantizes what batchpage only runs dense (MoE experts, embeddings), is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

import torch

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import UnsupportedModelError
from batchpage.model.layers import MergedLinear, linear, merged_linear
from batchpage.model.shard import ROW_PARALLEL
from batchpage.ops.linear import Linear
from batchpage.ops.quant_linear import QuantLinear
from batchpage.quant.formats import decode_stream, quantized_prefixes
from batchpage.quant.scheme import QuantScheme


def checkpoint_parts(model: CausalLM, name: str, module: Linear) -> list[str]:
    """The checkpoint prefixes a linear of ours loads from, in shard order."""
    if not isinstance(module, MergedLinear):
        return [name]
    parts: dict[int, str] = {}
    for theirs, (ours, shard) in model.RENAMES.items():
        if name.endswith(f".{ours}") and isinstance(shard, int):
            parts[shard] = name.removesuffix(ours) + theirs
    if sorted(parts) != list(range(len(module.part_sizes))):
        return [name]  # stored merged, as ours (Phi-3's qkv_proj)
    return [parts[i] for i in range(len(parts))]


def quantize_layout(model: CausalLM, schemes: Mapping[str, QuantScheme]) -> dict[str, QuantScheme]:
    """Replace the dense linears whose checkpoint prefixes (names without `model.`) `schemes`
    names; returns the scheme each prefix's linear holds (a merged linear whose parts differ,
    as a GGUF file's may, holds their widest form: `merged_scheme`). Raises
    UnsupportedModelError for quantized tensors no linear takes, ValueError for a merged linear
    quantized in part."""
    held: dict[str, QuantScheme] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        parts = checkpoint_parts(model, name, module)
        quantized = [p in schemes for p in parts]
        if not any(quantized):
            continue
        if not all(quantized):
            dense = [p for p in parts if p not in schemes]
            raise ValueError(
                f"the checkpoint quantizes {name}'s parts but not {dense}, which batchpage "
                "multiplies as one linear: use a checkpoint that quantizes all of them"
            )
        scheme = merged_scheme([schemes[p] for p in parts])
        sizes = module.part_sizes if len(parts) > 1 else (module.out_features,)
        layer = QuantLinear(
            module.in_features,
            sizes,
            module.bias is not None,
            scheme,
            module.weight.dtype,
            module.weight.device,
        )
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)
        held.update(dict.fromkeys(parts, scheme))
    left = sorted(set(schemes) - set(held))
    if left:
        raise UnsupportedModelError(
            f"the checkpoint holds quantized tensors for {left[:3]} ({len(left)} in all), which "
            "batchpage runs only as float weights (it runs quantized attention, MLP and lm_head "
            "linears, not MoE experts or embeddings): use a checkpoint that leaves them "
            "unquantized"
        )
    return held


def whole_linears(model: CausalLM, schemes: Mapping[str, QuantScheme]) -> dict[str, QuantScheme]:
    """`schemes` without the parts of a merged linear that the file quantizes only in part (a
    GGUF file may store attn_v in F16 beside Q8_0 attn_q): such a linear is loaded dense."""
    keep: dict[str, QuantScheme] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            parts = checkpoint_parts(model, name, module)
            if all(p in schemes for p in parts):
                keep.update({p: schemes[p] for p in parts})
    covered = {p for n, m in model.named_modules() if isinstance(m, Linear)
               for p in checkpoint_parts(model, n, m)}  # fmt: skip
    keep.update({p: s for p, s in schemes.items() if p not in covered})  # refused by the layout
    return keep


def merged_scheme(parts: list[QuantScheme]) -> QuantScheme:
    """One scheme for the parts of a merged linear: theirs where they agree, else (GGUF types
    that differ) the widest storage and the finest group, which holds each part exactly."""
    first = parts[0]
    if all(p == first for p in parts):
        return first
    if any(p.method != "gguf" for p in parts):
        raise ValueError("the parts of a merged linear are quantized with different schemes")
    groups = [p.group_size for p in parts]
    assert None not in groups
    labels = sorted({p.name for p in parts})
    return replace(
        first,
        bits=max(p.bits for p in parts) if any(p.bits > 4 for p in parts) else 4,
        group_size=math.gcd(*groups),  # type: ignore[arg-type]
        label="+".join(labels),
    )


def load_quantized(
    model: CausalLM,
    scheme: QuantScheme,
    names: Iterable[str],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ready `model` for a checkpoint of `scheme` whose tensor names are `names`, and return
    its tensor stream as the model loads it (each quantized linear's tensors decoded). Under
    GPTQ's act order a tensor-parallel rank holds its row-parallel linears (o, down) dense:
    their groups follow g_idx across the whole input, which the ranks split, so no share of
    them is whole groups; dequantized, each rank takes its columns as of a float weight."""
    prefixes = quantized_prefixes(names, scheme)
    dense = set()
    if scheme.act_order and model.shard.world > 1:
        dense = {p for p in prefixes if p.rsplit(".", 1)[-1] in ROW_PARALLEL}
    quantize_layout(model, dict.fromkeys(prefixes - dense, scheme))
    return decode_stream(weights, scheme, prefixes, dense)


def check_quantized(model: CausalLM) -> None:
    """After loading: every quantized linear's weight is whole (a merged linear's shards in one
    act order). Raises ValueError naming the linear."""
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            try:
                module.int_weight()
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None


@torch.no_grad()
def dequantize_layout(model: CausalLM) -> int:
    """Replace every loaded QuantLinear by a dense linear of the model's dtype holding its
    dequantized weight (engine option quantized_weights=False); returns how many."""
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for name, module in quantized:
        dtype = module.bias.dtype if module.bias is not None else model.embed_tokens.weight.dtype
        if len(module.part_sizes) > 1:
            dense: Linear = merged_linear(
                module.in_features, module.part_sizes, module.bias is not None, dtype,
                module.packed.device,
            )  # fmt: skip
        else:
            dense = linear(
                module.in_features, module.out_features, module.bias is not None, dtype,
                module.packed.device,
            )  # fmt: skip
        dense.weight.copy_(module.int_weight().dequantize(torch.float32))
        if module.bias is not None:
            dense.bias.copy_(module.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, dense)
    return len(quantized)


def quantize_activations(model: CausalLM) -> int:
    """Make every QuantLinear quantize its input rows to int8 with a scale each (W4A8, W8A8 for
    weight-only schemes: engine option int8_activations=True); returns how many. A W8A8
    checkpoint's linears already do."""
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for module in quantized:
        if not module.scheme.integer:
            raise ValueError(
                f"int8_activations needs integer weights, and this checkpoint's are "
                f"{module.scheme.name}: leave int8_activations off for it"
            )
        module.scheme = replace(module.scheme, int8_activations=True)
    return len(quantized)
