"""Reading a LoRA adapter as PEFT writes it, checked against the base model it is to run on.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors
are named `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A [r, in], B [out, r].
PEFT computes `base(x) + B(A(x)) * scaling` with scaling = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora; r is each module's own rank, as `rank_pattern` sets it); the scaling
is folded into B here, once.

What PEFT can write but this engine does not run is refused with the reason (AdapterError):
DoRA, LoRA biases, `modules_to_save`, `alpha_pattern`, trained token rows, `fan_in_fan_out`,
and any module other than the attention and MLP projections. So is what PEFT itself would not
run as written: a config that contradicts its tensors (a rank other than its `r` /
`rank_pattern`, a module its `target_modules` do not select: peft_config.py), and NaN or
infinite weights, which would turn every completion into garbage without an error. Every
tensor's name and shape is checked (against the base model's linear, when given) before any
data is read, so a folder costs at most the size of an adapter that fits the model; finiteness
is one pass over each tensor as it is read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchpage.lora.peft_config import PeftTargets
from batchpage.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT's config is a few kB; anything far larger is not one

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.((?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight$")
_PEFT_PREFIX = "base_model.model."  # PeftModel's; PEFT matches target_modules without it


class AdapterError(ValueError):
    """An adapter this engine cannot run; the message names the adapter and the problem."""


Fail = Callable[[str], AdapterError]


@dataclass(frozen=True)
class TargetShapes:
    """The base model's linears an adapter may target: (layer, PEFT module name, e.g.
    "self_attn.q_proj") -> (in_features, out_features)."""

    shapes: dict[tuple[int, str], tuple[int, int]]

    @property
    def module_names(self) -> list[str]:
        return sorted({name for _, name in self.shapes})


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights, float32 on the CPU: (layer, module) -> (A [r, in], B [out, r]),
    B already multiplied by the module's scaling."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(request: LoRARequest, targets: TargetShapes | None, max_rank: int) -> LoRAAdapter:
    """The adapter of `request`, checked against `targets` and max_lora_rank; AdapterError
    naming the adapter and what is wrong otherwise. `targets` None: everything but the fit to
    a base model is checked (a job checks model.loras so before its model loads)."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"{where}: {problem}")

    folder = Path(request.lora_path)
    if not folder.is_dir():
        raise fail("no such folder: give the folder PEFT's save_pretrained wrote")
    config = _read_config(folder / CONFIG_FILE, fail)
    alpha, rslora = _check_config(config, fail)
    peft = PeftTargets.of(config, fail)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        other = (
            " (only adapter_model.bin is there: save it with safe_serialization)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise fail(f"{WEIGHTS_FILE} is missing{other}")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            found = []
            for key in list(f.keys()):  # safe_open is not iterable
                target, which = _target_of(key, targets, fail)
                shape = list(f.get_slice(key).get_shape())
                base = None if targets is None else targets.shapes[target]
                rank = _check_shape(key, which, shape, base, max_rank, fail)
                want = peft.rank_of(_module_of(key))
                if rank != want:
                    raise fail(
                        f"tensor {key!r} has rank {rank}, but adapter_config.json gives its "
                        f"module rank {want} (r / rank_pattern): PEFT refuses it (size "
                        "mismatch); the config does not belong to these weights"
                    )
                found.append((key, target, which))
            _check_selected([_module_of(key) for key, _, _ in found], peft, fail)
            for key, target, which in found:
                tensor = f.get_tensor(key).float()
                _check_finite(key, tensor, fail)
                parts.setdefault(target, {})[which] = tensor
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise fail(f"{WEIGHTS_FILE} cannot be read: {exc}") from exc
    if not parts:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for target, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise fail(f"layer {target[0]} {target[1]} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]  # lora_B's too: both were checked against the config's rank
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        weights[target] = (a.contiguous(), (b * scaling).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(folder), rank, weights)


def _read_config(path: Path, fail: Fail) -> dict:
    if not path.is_file():
        raise fail(f"{CONFIG_FILE} is missing: give the folder PEFT's save_pretrained wrote")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise fail(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes: not a PEFT config")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise fail(f"{CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict, fail: Fail) -> tuple[float, bool]:
    """(lora_alpha, use_rslora), or AdapterError for what PEFT can write but this engine does
    not run."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise fail(f"peft_type is {kind!r}: only LoRA adapters run here")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "lora_bias": "adapters with LoRA biases are not supported",
        "modules_to_save": "modules_to_save (fully trained copies of base modules) is not "
        "supported: merge the adapter into the model instead",
        "alpha_pattern": "a per-module lora_alpha (alpha_pattern) is not supported",
        "trainable_token_indices": "trained token rows are not supported",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights) is not supported",
        "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    }
    for field, why in refused.items():
        if config.get(field):
            raise fail(why)
    if config.get("bias", "none") != "none":
        raise fail(f"bias={config['bias']!r}: adapters that train biases are not supported")
    alpha = config.get("lora_alpha", 8)
    # not 0 < alpha < inf: JSON's NaN and Infinity parse too
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise fail(f"lora_alpha must be a positive number, got {alpha!r}")
    return float(alpha), bool(config.get("use_rslora", False))


def _target_of(key: str, targets: TargetShapes | None, fail: Fail) -> tuple[tuple[int, str], str]:
    """((layer, module), "A" or "B") of a tensor name, or AdapterError."""
    m = _KEY.search(key)
    if m is None:
        allowed = (
            "the attention and MLP projections"
            if targets is None
            else ", ".join(targets.module_names)
        )
        raise fail(
            f"tensor {key!r} is not a lora_A / lora_B weight of a decoder layer's module: "
            f"only {allowed} can take adapters here"
        )
    layer, module, which = int(m.group(1)), m.group(2), m.group(3)
    if targets is not None and (layer, module) not in targets.shapes:
        if module not in targets.module_names:
            raise fail(
                f"unknown target module {module!r}: this model's adapters may target "
                f"{', '.join(targets.module_names)}"
            )
        raise fail(f"tensor {key!r} names layer {layer}, which this model does not have")
    return (layer, module), which


def _module_of(key: str) -> str:
    """The module a tensor adapts, named as PEFT matched it against target_modules."""
    return key.removeprefix(_PEFT_PREFIX).rsplit(".lora_", 1)[0]


def _check_selected(modules: list[str], peft: PeftTargets, fail: Fail) -> None:
    """AdapterError when the config does not select a module its tensors adapt: PEFT would
    drop those tensors, or refuse the folder when it selects none of them."""
    left_out = [m for m in modules if not peft.selects(m)]
    if not left_out:
        return
    names = peft.target_modules
    rule = f"target_modules {names if isinstance(names, str) else list(names or ())!r}"
    if len(left_out) == len(modules):
        raise fail(
            f"adapter_config.json's {rule} select none of the modules its tensors adapt (such "
            f'as {left_out[0]}): PEFT would not load these weights ("Target modules ... not '
            'found in the base model"); the config does not belong to them'
        )
    raise fail(
        f"its tensors adapt {left_out[0]}, which adapter_config.json's {rule} (less "
        "exclude_modules, within layers_to_transform) do not select: PEFT would leave those "
        "tensors out; the config does not belong to these weights"
    )


def _check_finite(key: str, tensor: torch.Tensor, fail: Fail) -> None:
    if not bool(torch.isfinite(tensor).all()):
        kind = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
        raise fail(
            f"tensor {key!r} holds {kind} values: every completion would be garbage (did its "
            "training diverge?)"
        )


def _check_shape(
    key: str,
    which: str,
    shape: list[int],
    base: tuple[int, int] | None,
    max_rank: int,
    fail: Fail,
) -> int:
    """The tensor's rank, once its shape fits `base`'s linear (in, out) and max_rank."""
    if len(shape) != 2:
        raise fail(f"tensor {key!r} has shape {shape}, not a matrix")
    rank = shape[0] if which == "A" else shape[1]
    # Without a base model any matrix fits: only the rank is checked.
    d_in, d_out = base if base is not None else (shape[1], shape[0])
    want = [rank, d_in] if which == "A" else [d_out, rank]
    if shape != want:
        raise fail(
            f"tensor {key!r} has shape {shape}, the base model's linear needs {want}: the "
            "adapter was trained on another base model"
        )
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank={max_rank}: raise max_lora_rank")
    if rank < 1:
        raise fail(f"tensor {key!r} has rank 0")
    return rank
