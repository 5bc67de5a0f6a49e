"""What an adapter_config.json says about its tensors, read the way PEFT reads it.

PEFT builds a LoRA module for each base module that `target_modules` selects (less
`exclude_modules`; `layers_to_transform` / `layers_pattern` narrow a list of names to some
layers), with the rank `rank_pattern` gives it or else `r`, and only then loads the tensors
into those modules. So a config can contradict its tensors: a tensor of a module the config does
not select is dropped by PEFT (and when the config selects no module at all, PEFT refuses the
folder: "Target modules ... not found in the base model"), and a tensor of another rank fails
PEFT's load with a size mismatch. PeftTargets answers both questions for a module's name as PEFT
saw it (e.g. "model.layers.0.self_attn.q_proj"), with PEFT's own matching rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

PEFT_DEFAULT_RANK = 8  # LoraConfig's r when the config leaves it out
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear but the output layer


@dataclass(frozen=True)
class PeftTargets:
    """The module selection and the ranks of one adapter_config.json."""

    target_modules: str | tuple[str, ...] | None  # a regex, names, or None (PEFT's defaults)
    exclude_modules: str | tuple[str, ...]
    layers: tuple[int, ...] | None  # layers_to_transform
    layers_pattern: tuple[str, ...]
    r: int
    rank_pattern: tuple[tuple[str, int], ...]  # in the config's order: PEFT takes the first match

    @classmethod
    def of(cls, config: dict, fail: Callable[[str], Exception]) -> PeftTargets:
        """The config's fields, type-checked (each regex compiled once here, so a bad one is
        the adapter's error rather than a crash later)."""
        targets = _names_or_regex(config.get("target_modules"), "target_modules", fail)
        exclude = _names_or_regex(config.get("exclude_modules"), "exclude_modules", fail) or ()
        layers = config.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if layers is not None and not _all(layers, int):
            raise fail(f"layers_to_transform must be a layer index or a list of them: {layers!r}")
        pattern = config.get("layers_pattern") or []
        pattern = [pattern] if isinstance(pattern, str) else pattern
        if not _all(pattern, str):
            raise fail(f"layers_pattern must be a name or a list of names: {pattern!r}")
        r = config.get("r", PEFT_DEFAULT_RANK)
        ranks = config.get("rank_pattern") or {}
        if not _positive_int(r):
            raise fail(f"r must be a positive integer, got {r!r}")
        if not isinstance(ranks, dict) or not all(_positive_int(v) for v in ranks.values()):
            raise fail(f"rank_pattern must map module names to positive integers: {ranks!r}")
        for text in [*pattern, *ranks]:
            _compile(text, "layers_pattern / rank_pattern", fail)
        return cls(
            targets,
            exclude,
            None if layers is None else tuple(layers),
            tuple(pattern),
            r,
            tuple(ranks.items()),
        )

    def selects(self, module: str) -> bool:
        """Whether PEFT puts a LoRA module on `module` (PEFT's check_target_module_exists)."""
        if _matches(self.exclude_modules, module):
            return False
        if self.target_modules is None or _all_linear(self.target_modules):
            return True  # PEFT's defaults by model type, or every linear: not checked here
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not any(module.endswith(f".{name}") for name in self.target_modules):
            return False
        if not self.layers:  # PEFT treats an empty list as no restriction
            return True
        return self._layer_of(module) in self.layers

    def rank_of(self, module: str) -> int:
        """The rank PEFT gives `module`: the first rank_pattern key that matches the end of
        its name, else r (PEFT's get_pattern_key)."""
        for key, rank in self.rank_pattern:
            if re.match(rf"(.*\.)?({key})$", module):
                return rank
        return self.r

    def _layer_of(self, module: str) -> int | None:
        """The first numbered segment of the name (not an expert's index after it), as PEFT
        finds it."""
        if not self.layers_pattern:
            m = re.match(r".*?\.[^.]*\.(\d+)\.", module)
            return None if m is None else int(m.group(1))
        for pattern in self.layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(\d+)\.", module)
            if m is not None:
                return int(m.group(1))
        return None


def _names_or_regex(
    value: object, field: str, fail: Callable[[str], Exception]
) -> str | tuple[str, ...] | None:
    if value is None or isinstance(value, str):
        if isinstance(value, str) and not _all_linear(value):
            _compile(value, field, fail)
        return value
    if isinstance(value, list) and _all(value, str):
        return tuple(value)
    raise fail(f"{field} must be a regular expression or a list of module names: {value!r}")


def _all_linear(value: str | tuple[str, ...]) -> bool:
    return isinstance(value, str) and value.lower() == ALL_LINEAR


def _matches(rule: str | tuple[str, ...], module: str) -> bool:
    if isinstance(rule, str):
        return bool(rule) and re.fullmatch(rule, module) is not None
    return module in rule or any(module.endswith(f".{name}") for name in rule)


def _compile(text: str, field: str, fail: Callable[[str], Exception]) -> None:
    try:
        re.compile(text)
    except re.error as exc:
        raise fail(f"{field} holds {text!r}, not a regular expression: {exc}") from exc


def _all(values: object, kind: type) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, kind) and not isinstance(v, bool) for v in values
    )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
