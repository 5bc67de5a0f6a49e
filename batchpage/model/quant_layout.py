"""Give a freshly built model the quantized linears its checkpoint holds, before it loads.

The model is built as for a float checkpoint; each linear the checkpoint stores quantized then
holds that form (`LoadedLinear.hold`: its spec's scheme), so that `load_weights` fills IntWeight
tensors by the same names and shard keys as dense ones. A merged linear (q/k/v, gate/up) is
quantized when all its checkpoint parts are; a checkpoint that quantizes some parts of one and
not others, or quantizes what batchpage only runs dense (MoE experts, embeddings), is refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import NamedTuple

import torch

from batchpage.model.causal_lm import CausalLM
from batchpage.model.config import UnsupportedModelError
from batchpage.model.loaded_linear import LoadedLinear
from batchpage.model.shard import ROW_PARALLEL
from batchpage.quant.formats import decode_stream, quantized_prefixes
from batchpage.quant.scheme import QuantScheme


def checkpoint_parts(model: CausalLM, name: str, module: LoadedLinear) -> list[str]:
    """The checkpoint prefixes a linear of ours loads from, in shard order."""
    if len(module.spec.part_sizes) == 1:
        return [name]
    parts: dict[int, str] = {}
    for theirs, (ours, shard) in model.RENAMES.items():
        if name.endswith(f".{ours}") and isinstance(shard, int):
            parts[shard] = name.removesuffix(ours) + theirs
    if sorted(parts) != list(range(len(module.spec.part_sizes))):
        return [name]  # stored merged, as ours (Phi-3's qkv_proj)
    return [parts[i] for i in range(len(parts))]


def rank_holds(model: CausalLM, name: str, module: LoadedLinear, scheme: QuantScheme) -> bool:
    """Whether this rank's share of a linear quantized in `scheme` is whole groups: always for
    a column-parallel linear (its output rows split); for a row-parallel one (o, down: its
    inputs split) only when each share's inputs are whole groups of `group_size`, which GPTQ's
    act order never gives (its groups follow g_idx across the whole input)."""
    if model.shard.world == 1 or name.rsplit(".", 1)[-1] not in ROW_PARALLEL:
        return True
    group = scheme.group_size
    return group is None or (not scheme.act_order and module.in_features % group == 0)


def linears(model: CausalLM) -> list[tuple[str, LoadedLinear]]:
    """The model's linears as loaded (before bind), by name, the tied quantized head among
    them."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoadedLinear)]


class Layout(NamedTuple):
    """`held`: the scheme each quantized checkpoint prefix's linear holds; `dense`: the
    quantized prefixes loaded dense, a tensor-parallel share of them not being whole groups."""

    held: dict[str, QuantScheme]
    dense: set[str]


def quantize_layout(model: CausalLM, schemes: Mapping[str, QuantScheme]) -> Layout:
    """Make the linears whose checkpoint prefixes (names without `model.`) `schemes` names hold
    their quantized form (a merged linear whose parts differ, as a GGUF file's may, holds their
    widest form: `merged_scheme`), but where this rank's share is not whole groups
    (`rank_holds`: those load dense, decoded). Raises UnsupportedModelError for quantized
    tensors no linear takes, ValueError for a merged linear quantized in part."""
    held: dict[str, QuantScheme] = {}
    dense: set[str] = set()
    for name, module in linears(model):
        parts = checkpoint_parts(model, name, module)
        quantized = [p in schemes for p in parts]
        if not any(quantized):
            continue
        if not all(quantized):
            missing = [p for p in parts if p not in schemes]
            raise ValueError(
                f"the checkpoint quantizes {name}'s parts but not {missing}, which batchpage "
                "multiplies as one linear: use a checkpoint that quantizes all of them"
            )
        scheme = merged_scheme([schemes[p] for p in parts])
        if not rank_holds(model, name, module, scheme):
            dense.update(parts)
            continue
        module.hold(scheme)
        held.update(dict.fromkeys(parts, scheme))
    left = sorted(set(schemes) - set(held) - dense)
    if left:
        raise UnsupportedModelError(
            f"the checkpoint holds quantized tensors for {left[:3]} ({len(left)} in all), which "
            "batchpage runs only as float weights (it runs quantized attention, MLP and lm_head "
            "linears, not MoE experts or embeddings): use a checkpoint that leaves them "
            "unquantized"
        )
    return Layout(held, dense)


def whole_linears(model: CausalLM, schemes: Mapping[str, QuantScheme]) -> dict[str, QuantScheme]:
    """`schemes` without the parts of a merged linear that the file quantizes only in part (a
    GGUF file may store attn_v in F16 beside Q8_0 attn_q): such a linear is loaded dense."""
    keep: dict[str, QuantScheme] = {}
    for name, module in linears(model):
        parts = checkpoint_parts(model, name, module)
        if all(p in schemes for p in parts):
            keep.update({p: schemes[p] for p in parts})
    covered = {p for n, m in linears(model) for p in checkpoint_parts(model, n, m)}
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
    its tensor stream as the model loads it (each quantized linear's tensors decoded; those a
    tensor-parallel rank cannot hold in whole groups, `rank_holds`, dequantized: each rank then
    takes its columns as of a float weight)."""
    prefixes = quantized_prefixes(names, scheme)
    layout = quantize_layout(model, dict.fromkeys(prefixes, scheme))
    return decode_stream(weights, scheme, prefixes, layout.dense)


def check_quantized(model: CausalLM) -> None:
    """After loading: every quantized linear's weight is whole (a merged linear's shards in one
    act order). Raises ValueError naming the linear."""
    for name, module in linears(model):
        try:
            module.weights()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def quantize_activations(model: CausalLM) -> int:
    """Make every quantized linear quantize its input rows to int8 with a scale each (W4A8,
    W8A8 for weight-only schemes: engine option int8_activations=True); returns how many. A
    W8A8 checkpoint's linears already do."""
    quantized = [m for _, m in linears(model) if m.spec.scheme is not None]
    for module in quantized:
        scheme = module.spec.scheme
        assert scheme is not None
        if not scheme.integer:
            raise ValueError(
                f"int8_activations needs integer weights, and this checkpoint's are "
                f"{scheme.name}: leave int8_activations off for it"
            )
        module.spec = replace(module.spec, scheme=replace(scheme, int8_activations=True))
    return len(quantized)
