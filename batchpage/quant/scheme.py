"""QuantScheme: what a checkpoint's `quantization_config` (or `compression_config`) declares,
read once from config.json, and the refusal of every scheme batchpage does not run.

Which linears a checkpoint quantized is read from its tensors (a `qweight` or `weight_packed`
beside the layer), not from the config's ignore lists: the config says how, the files say
where. The lists still matter for one check: an lm_head or a layer the config leaves
unquantized must arrive as a dense weight, which the loader's name checks enforce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from batchpage.errors import UnsupportedModelError

SUPPORTED = (
    "awq (GEMM, 4-bit, zero points), gptq (4/8-bit, sym or asym, desc_act), "
    "compressed-tensors (pack-quantized int4/int8 weight-only, int-quantized W8A8, "
    "float-quantized FP8 e4m3 by tensor, channel or block), fp8 (e4m3, per tensor or "
    "weight_block_size with weight_scale_inv)"
)

Method = Literal["awq", "gptq", "compressed-tensors", "fp8", "gguf"]


@dataclass(frozen=True)
class QuantScheme:
    """A weight scheme: W = scale * (q - zero) per group of `group_size` inputs, q an integer,
    or (float8) W = scale * q with q an FP8 e4m3 value and a scale per block of `block_rows`
    outputs by `group_size` inputs."""

    method: Method
    bits: int
    group_size: int | None  # None: one group per output channel (the whole input row)
    symmetric: bool
    act_order: bool  # GPTQ desc_act: groups follow g_idx, not the input order
    # GPTQ's original format stores each zero point minus one ("gptq"); "gptq_v2" stores it.
    zero_stored_minus_one: bool = False
    # Activations quantized per token to int8 at run time: compressed-tensors int-quantized
    # (W8A8), or any scheme under the engine option int8_activations.
    int8_activations: bool = False
    # A GGUF tensor's type name ("q4_1"), the format's name in stats.
    label: str | None = None
    # FP8 e4m3 weights (bits 8): float8_e4m3fn codes, no zero point. The checkpoint's scales
    # cover `block_rows` output rows each (1: per channel; None: every row, per tensor); its
    # FP8 activations, where it declares them, run in the model's dtype.
    float8: bool = False
    block_rows: int | None = 1

    @property
    def integer(self) -> bool:
        """Whether q are integers (what the int kernels and int8 activations take)."""
        return not self.float8

    @property
    def name(self) -> str:
        """The weight format's name in stats: "awq_int4", "gptq_int8", "q4_1", and with int8
        activations "ct_w8a8", "gptq_w4a8", "q4_1_a8"."""
        if self.label is not None:
            return f"{self.label}_a8" if self.int8_activations else self.label
        if self.float8:
            return "fp8" if self.method == "fp8" else "ct_fp8"
        method = {"compressed-tensors": "ct"}.get(self.method, self.method)
        kind = f"w{self.bits}a8" if self.int8_activations else f"int{self.bits}"
        return f"{method}_{kind}"


def read_quant_scheme(cfg: Mapping[str, Any]) -> QuantScheme | None:
    """The checkpoint's scheme, None for a float checkpoint. Raises UnsupportedModelError naming
    the method and what is supported for anything else."""
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        raise ValueError(
            f"quantization_config is {type(quant).__name__}, not an object: restore the "
            "model's config.json"
        )
    method = quant.get("quant_method", "unknown")
    if method == "gptq":
        return _gptq(quant)
    if method == "awq":
        return _awq(quant)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fp8":
        return _fp8(quant)
    raise _refuse(method, "")


def _refuse(method: object, detail: str) -> UnsupportedModelError:
    what = f" ({detail})" if detail else ""
    return UnsupportedModelError(
        f"this checkpoint is quantized with quant_method={method!r}{what}, which batchpage "
        f"does not run; it runs {SUPPORTED}: use one of those, or the unquantized checkpoint"
    )


def _bits(quant: Mapping[str, Any], method: str, key: str, allowed: tuple[int, ...]) -> int:
    bits = quant.get(key)
    if bits not in allowed:
        raise _refuse(method, f"{key}={bits!r}; supported: {allowed}")
    return int(bits)


def _group(quant: Mapping[str, Any], method: str) -> int | None:
    group = quant.get("group_size", 128)
    if group in (-1, None):
        return None
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 4:
        raise _refuse(method, f"group_size={group!r}; supported: -1 or a multiple of 4")
    return group


def _gptq(quant: Mapping[str, Any]) -> QuantScheme:
    bits = _bits(quant, "gptq", "bits", (4, 8))
    fmt = quant.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format={fmt!r}; supported: gptq, gptq_v2")
    return QuantScheme(
        "gptq",
        bits,
        _group(quant, "gptq"),
        symmetric=bool(quant.get("sym", True)),
        act_order=bool(quant.get("desc_act", False)),
        zero_stored_minus_one=fmt == "gptq",
    )


def _awq(quant: Mapping[str, Any]) -> QuantScheme:
    bits = _bits(quant, "awq", "bits", (4,)) if "bits" in quant else 4
    if "w_bit" in quant:
        bits = _bits(quant, "awq", "w_bit", (4,))
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version={version!r}; supported: gemm")
    group = _group({"group_size": quant.get("group_size", quant.get("q_group_size", 128))}, "awq")
    zero_point = bool(quant.get("zero_point", True))
    return QuantScheme("awq", bits, group, symmetric=not zero_point, act_order=False)


def _block(value: object, method: str, key: str) -> tuple[int, int]:
    """A [rows, inputs] block of one scale, each a positive int."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    if not ok:
        raise _refuse(method, f"{key}={value!r}; supported: [rows, inputs] of positive ints")
    rows, cols = value  # type: ignore[misc]
    return int(rows), int(cols)


def _fp8(quant: Mapping[str, Any]) -> QuantScheme:
    """HF's fp8 (DeepSeek's and Qwen3-FP8's releases): e4m3 weights, a weight_scale_inv per
    weight_block_size block, or without one a weight_scale per tensor."""
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", f"fmt={fmt!r}; supported: e4m3")
    acts = quant.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        raise _refuse("fp8", f"activation_scheme={acts!r}; supported: dynamic, static")
    block = quant.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", 8, None, True, False, float8=True, block_rows=None)
    rows, cols = _block(block, "fp8", "weight_block_size")
    return QuantScheme("fp8", 8, cols, True, False, float8=True, block_rows=rows)


def _ct_float(weights: Mapping[str, Any], acts: object) -> QuantScheme:
    """compressed-tensors float-quantized: FP8 e4m3 weights scaled per tensor, channel or
    block; FP8 activations, if declared, are not quantized here."""
    method = "compressed-tensors"
    if weights.get("num_bits") != 8:
        raise _refuse(method, f"float weights of {weights.get('num_bits')!r} bits; supported: 8")
    if acts and (not isinstance(acts, Mapping) or acts.get("type") != "float"):
        raise _refuse(method, "float-quantized weights with non-float activations")
    strategy = weights.get("strategy")
    if strategy == "tensor":
        return QuantScheme(method, 8, None, True, False, float8=True, block_rows=None)
    if strategy == "channel":
        return QuantScheme(method, 8, None, True, False, float8=True, block_rows=1)
    if strategy == "block":
        rows, cols = _block(weights.get("block_structure"), method, "block_structure")
        return QuantScheme(method, 8, cols, True, False, float8=True, block_rows=rows)
    raise _refuse(method, f"float weight strategy {strategy!r}; supported: tensor, channel, block")


def _compressed_tensors(quant: Mapping[str, Any]) -> QuantScheme:
    fmt = quant.get("format")
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        count = len(groups) if isinstance(groups, Mapping) else groups
        raise _refuse("compressed-tensors", f"config_groups: {count!r}; supported: exactly one")
    (group,) = groups.values()
    if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
        raise _refuse("compressed-tensors", "a config group without weights")
    fmt = group.get("format") or fmt
    weights = group["weights"]
    acts = group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse("compressed-tensors", "quantized output activations")
    if weights.get("type") == "float":
        if fmt != "float-quantized":
            raise _refuse("compressed-tensors", f"float weights in format={fmt!r}")
        return _ct_float(weights, acts)
    if weights.get("type") != "int":
        raise _refuse("compressed-tensors", f"weights of type {weights.get('type')!r}")
    bits = _bits(weights, "compressed-tensors", "num_bits", (4, 8))
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse("compressed-tensors", f"weight strategy {strategy!r}")
    group_size = _group(weights, "compressed-tensors") if strategy == "group" else None
    if strategy == "group" and group_size is None:
        raise _refuse("compressed-tensors", "strategy group without a group_size")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "static", "weight"):
        raise _refuse("compressed-tensors", f"actorder={actorder!r}; supported: none, weight")
    int8_acts = False
    if fmt == "pack-quantized":
        if acts:
            raise _refuse("compressed-tensors", "pack-quantized with quantized activations")
    elif fmt == "int-quantized":
        want = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
        acts_ok = isinstance(acts, Mapping) and all(acts.get(k) == v for k, v in want.items())
        if bits != 8 or not acts_ok:
            raise _refuse(
                "compressed-tensors",
                "int-quantized needs 8-bit weights and dynamic per-token int8 activations",
            )
        int8_acts = True
    else:
        raise _refuse(
            "compressed-tensors",
            f"format={fmt!r}; supported: pack-quantized, int-quantized, float-quantized",
        )
    return QuantScheme(
        "compressed-tensors",
        bits,
        group_size,
        symmetric=bool(weights.get("symmetric", True)),
        act_order=False,
        int8_activations=int8_acts,
    )
