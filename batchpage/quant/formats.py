"""Each checkpoint format's tensors for one linear -> IntWeight's tensors, as a stream.

A quantized linear P arrives as several tensors (GPTQ: P.qweight, P.qzeros, P.scales, P.g_idx;
AWQ: P.qweight, P.qzeros, P.scales; compressed-tensors: P.weight_packed, P.weight_scale,
P.weight_shape, P.weight_zero_point; W8A8: P.weight int8, P.weight_scale). `decode_stream`
holds a linear's tensors until it has them all, then yields P.packed, P.scales, P.offsets (and
P.perm under act order) in IntWeight's layout (int_weight.py), which the model's quantized
linears load as they load dense weights. The same code runs on meta tensors, for the header
checks (hf_checks.py), where the value checks are skipped.

Layouts, as each format's writer packs them:
- GPTQ: qweight int32 [K * bits / 32, N], packed along K, value t of a word at bits
  [bits * t, bits * (t + 1)); qzeros int32 [G, N * bits / 32], packed along N the same way,
  each zero point minus one in the original format; scales [G, N]; g_idx int32 [K], the group
  of each input. W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k].
- AWQ (GEMM): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8], packed along N in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i of a word holds column 8w + ORDER[i]); scales [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, ceil(K * bits / 32)] along K, each
  signed value stored plus 2^(bits - 1); weight_scale [N, G]; an asymmetric scheme's
  weight_zero_point packed along N. W = scale * (q - zero). int-quantized: weight int8 [N, K].
- FP8 (fp8, compressed-tensors float-quantized): weight float8_e4m3fn [N, K] and one scale per
  block of R rows by C inputs: weight_scale_inv (fp8 with weight_block_size; despite its name
  it multiplies) or weight_scale, [ceil(N / R), ceil(K / C)]; per channel [N, 1] or [N]; per
  tensor one value. W[n, k] = weight[n, k] * scale[n // R, k // C]. A static scheme's
  input_scale is dropped (activations run in the model's dtype).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch

from batchpage.quant.int_weight import IntWeight
from batchpage.quant.scheme import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _fp8_scale(scheme: QuantScheme) -> str:
    return "weight_scale_inv" if scheme.method == "fp8" and scheme.block_rows else "weight_scale"


def marker_leaf(scheme: QuantScheme) -> str:
    """The tensor that marks a linear as quantized; the others it waits for."""
    if scheme.float8:
        return _fp8_scale(scheme)
    if scheme.int8_activations:  # W8A8's layers keep the name `weight`
        return "weight_scale"
    return {"gptq": "qweight", "awq": "qweight"}.get(scheme.method, "weight_packed")


def dropped_leaves(scheme: QuantScheme) -> tuple[str, ...]:
    """Tensors of a quantized linear batchpage does not use (a static FP8 input scale)."""
    return ("input_scale",) if scheme.float8 else ()


def required_leaves(scheme: QuantScheme) -> tuple[str, ...]:
    if scheme.float8:
        return ("weight", _fp8_scale(scheme))
    if scheme.method == "gptq":
        return ("qweight", "qzeros", "scales") + (("g_idx",) if scheme.act_order else ())
    if scheme.method == "awq":
        return ("qweight", "qzeros", "scales")
    if scheme.int8_activations:
        return ("weight", "weight_scale") + (() if scheme.symmetric else ("weight_zero_point",))
    zero = () if scheme.symmetric else ("weight_zero_point",)
    return ("weight_packed", "weight_scale", "weight_shape", *zero)


def optional_leaves(scheme: QuantScheme) -> tuple[str, ...]:
    """Tensors a format may write beside the required ones and batchpage does not need."""
    return ("g_idx",) if scheme.method == "gptq" and not scheme.act_order else ()


def quantized_prefixes(names: Iterable[str], scheme: QuantScheme) -> set[str]:
    """The linears a checkpoint holds quantized (names without `model.`), from its tensor names
    (marker_leaf: W8A8 and FP8 layers keep the name `weight`, theirs are those with a scale)."""
    marker = marker_leaf(scheme)
    out = set()
    for name in names:
        prefix, _, leaf = name.removeprefix("model.").rpartition(".")
        if leaf == marker:
            out.add(prefix)
    return out


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, W] packed along its last dimension -> uint8 values [R, W * 32 / bits], value t
    of word w at index w * 32 / bits + t (little-endian words, as the formats write them)."""
    as_bytes = packed.contiguous().view(torch.uint8)  # [R, 4W], a word's low byte first
    if bits == 8:
        return as_bytes
    return torch.stack([as_bytes & 0xF, as_bytes >> 4], dim=-1).reshape(packed.shape[0], -1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:  # uint8 [N, K] (values < 16) -> [N, ceil(K/2)]
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _store(q: torch.Tensor, bits: int) -> torch.Tensor:  # uint8 [N, K] -> IntWeight.packed
    return _nibbles(q) if bits == 4 else q.contiguous()


def _group(scheme: QuantScheme, k: int, groups: int, prefix: str) -> int:
    """The group size, checked against the scales' group count."""
    group = k if scheme.group_size is None else scheme.group_size
    if groups != -(-k // group):
        raise ValueError(
            f"{prefix} has {groups} scale groups for {k} inputs, but group_size {group} makes "
            f"{-(-k // group)}: the checkpoint's quantization_config does not match its tensors"
        )
    return group


def decode_gptq(t: dict[str, torch.Tensor], scheme: QuantScheme, prefix: str) -> IntWeight:
    bits, qweight, scales = scheme.bits, t["qweight"], t["scales"]
    n = qweight.shape[1]
    k = qweight.shape[0] * 32 // bits
    q = unpack_rows(qweight.t(), bits)[:, :k]  # [N, K]
    groups = scales.shape[0]
    zeros = unpack_rows(t["qzeros"], bits)[:, :n].to(torch.int32)  # [G, N]
    if scheme.zero_stored_minus_one:  # a zero point of 0 was stored as 2^bits - 1
        zeros = (zeros + 1) & ((1 << bits) - 1)
    group = _group(scheme, k, groups, prefix)
    perm = None
    g_idx = t.get("g_idx")
    if scheme.act_order:
        assert g_idx is not None
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not g_idx.is_meta:
            _check_groups(g_idx[perm], group, groups, prefix)
            q = q[:, perm]
    elif g_idx is not None and not g_idx.is_meta:
        _check_groups(g_idx, group, groups, prefix)
    scale = scales.t().float().contiguous()  # [N, G]
    offsets = -scale * zeros.t().float()
    return IntWeight(_store(q, bits), scale, offsets.contiguous(), bits, group, k, perm)


def _check_groups(g_idx: torch.Tensor, group: int, groups: int, prefix: str) -> None:
    want = torch.arange(g_idx.shape[0], device=g_idx.device) // group
    if g_idx.shape[0] == 0 or not torch.equal(g_idx.to(torch.int64), want) or groups < want[-1] + 1:
        raise ValueError(
            f"{prefix}.g_idx does not assign each group {group} inputs: the checkpoint's "
            "quantization_config (group_size, desc_act) does not match its tensors"
        )


def decode_awq(t: dict[str, torch.Tensor], scheme: QuantScheme, prefix: str) -> IntWeight:
    qweight, scales = t["qweight"], t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])
    cols = (torch.arange(n) // 8) * 8 + inverse[torch.arange(n) % 8]  # column j's nibble
    q = unpack_rows(qweight, 4)[:, cols]  # [K, N]
    zeros = unpack_rows(t["qzeros"], 4)[:, cols].to(torch.int32)  # [G, N]
    group = _group(scheme, k, scales.shape[0], prefix)
    scale = scales.t().float().contiguous()
    offsets = (-scale * zeros.t().float()).contiguous()
    return IntWeight(_store(q.t().contiguous(), 4), scale, offsets, 4, group, k)


def decode_compressed(t: dict[str, torch.Tensor], scheme: QuantScheme, prefix: str) -> IntWeight:
    bits, scale = scheme.bits, t["weight_scale"].float()
    if scheme.int8_activations:
        q = (t["weight"].to(torch.int16) + 128).to(torch.uint8)  # [N, K], signed -> + 128
        n, k = q.shape
    else:
        packed = t["weight_packed"]
        n = packed.shape[0]
        k = packed.shape[1] * 32 // bits
        if not t["weight_shape"].is_meta:
            n_shape, k = (int(v) for v in t["weight_shape"].tolist())
            if n_shape != n or k > packed.shape[1] * 32 // bits:
                raise ValueError(f"{prefix}.weight_shape {(n_shape, k)} does not fit its packing")
        q = unpack_rows(packed, bits)[:, :k]  # [N, K], signed value + 2^(bits - 1)
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    groups = scale.shape[1]
    zero = torch.zeros_like(scale)
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        if zp.shape[0] != n:  # packed along N (told by shape: the header checks have no dtypes)
            zp = unpack_rows(zp.t(), bits)[:, :n].t().to(torch.int32) - (1 << (bits - 1))
        zero = zp.float().reshape(n, groups)
    group = _group(scheme, k, groups, prefix)
    offsets = -scale * (zero + (1 << (bits - 1)))
    return IntWeight(_store(q, bits), scale.contiguous(), offsets.contiguous(), bits, group, k)


def decode_fp8(t: dict[str, torch.Tensor], scheme: QuantScheme, prefix: str) -> IntWeight:
    weight, scale = t["weight"], t[_fp8_scale(scheme)].float()
    if weight.dim() != 2:
        raise ValueError(f"{prefix}.weight has shape {tuple(weight.shape)}, not [out, in]")
    n, k = weight.shape
    if weight.is_meta:  # the header checks: shapes only
        packed = torch.empty(n, k, dtype=torch.uint8, device="meta")
    elif weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn, in an FP8 e4m3 checkpoint: "
            "its files do not match its quantization_config"
        )
    else:
        packed = weight.contiguous().view(torch.uint8)
    rows, group = scheme.block_rows or n, scheme.group_size or k
    want = (-(-n // rows), -(-k // group))
    if scale.dim() < 2:  # per tensor, () or [1]; per channel, [N]
        scale = scale.reshape(-1, 1)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{prefix}.{_fp8_scale(scheme)} has shape {tuple(scale.shape)}, but blocks of "
            f"{rows} x {group} over a [{n}, {k}] weight make {list(want)}: the checkpoint's "
            "quantization_config does not match its tensors"
        )
    scales = scale.repeat_interleave(rows, dim=0)[:n].contiguous()  # [N, G]
    zeros = torch.zeros_like(scales)
    return IntWeight(packed, scales, zeros, 8, group, k, float8=True)


DECODERS = {"gptq": decode_gptq, "awq": decode_awq, "compressed-tensors": decode_compressed}


def decode_stream(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: QuantScheme,
    prefixes: set[str],
    dense: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear's set replaced by IntWeight's
    tensors (for the prefixes in `dense`: by its dequantized float32 `weight`); every other
    tensor passes as it is. Raises ValueError naming a linear whose set is incomplete at the
    end."""
    need, extra, drop = required_leaves(scheme), optional_leaves(scheme), dropped_leaves(scheme)
    decode = decode_fp8 if scheme.float8 else DECODERS[scheme.method]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.removeprefix("model.").rpartition(".")
        if prefix in prefixes and leaf in drop:
            continue
        if prefix not in prefixes or (leaf not in need and leaf not in extra):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(leaf in parts for leaf in need):
            del pending[prefix]
            weight = decode(parts, scheme, prefix)
            if prefix in dense:
                yield f"{prefix}.weight", weight.dequantize(torch.float32)
            else:
                yield from _int_tensors(prefix, weight)
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = [leaf for leaf in need if leaf not in parts]
        raise ValueError(
            f"quantized linear {prefix!r} lacks {', '.join(missing)} ({scheme.method}): the "
            "checkpoint's files are incomplete"
        )


def _int_tensors(prefix: str, w: IntWeight) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.packed", w.packed
    yield f"{prefix}.scales", w.scales
    yield f"{prefix}.offsets", w.offsets
    if w.perm is not None:
        yield f"{prefix}.perm", w.perm
