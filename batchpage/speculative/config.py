"""SpeculativeConfig: `speculative_config` in vLLM's shape, checked, with vLLM's defaults filled.

    SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8})

Keys and meanings (vLLM's `vllm/config/speculative.py`):
- method: "ngram" (prompt lookup, ngram.py) or "suffix" (suffix decoding, suffix.py). vLLM's
  model-based methods (eagle, mtp, draft_model, ...) are refused.
- num_speculative_tokens: the most tokens drafted for a sequence in a step (>= 1). Required for
  ngram; suffix decoding sizes its drafts itself and takes it as a cap, by default
  suffix_decoding_max_tree_depth (as vLLM does).
- prompt_lookup_min / prompt_lookup_max (ngram only): the n-gram lengths matched, longest first.
  Neither given: 5 and 5; one given: the other takes its value (vLLM's code).
- suffix_decoding_max_tree_depth (24): the longest context the suffix structures count; it bounds
  the match length plus the draft length.
- suffix_decoding_max_cached_requests (10000): finished requests whose outputs stay cached for
  later requests (oldest evicted first); 0 turns that cache off (each request's own tokens are
  still used).
- suffix_decoding_max_spec_factor (1.0): a draft has at most factor * match length tokens.
- suffix_decoding_min_token_prob (0.1): drafting stops at the first token whose estimated
  probability (from counts) is below this.

A key this module does not know, a key of the other method, or a value out of range is a
ValueError naming the key and what it allows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from batchpage.speculative.drafter import Drafter
from batchpage.speculative.ngram import NgramDrafter
from batchpage.speculative.suffix import SuffixDrafter

METHODS = ("ngram", "suffix")
METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}
NGRAM_DEFAULT_N = 5  # vLLM's prompt_lookup_min/max when neither is given
SUFFIX_DEFAULTS: dict[str, object] = {  # vLLM's
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}


def _integer(key: str, value: object, low: int) -> int:
    # bool is an int subclass; True is not a token count.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config: {key} must be an integer >= {low}; got {value!r}")
    return value


def _number(key: str, value: object, low: float, high: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:  # type: ignore[arg-type]
        span = f">= {low}" if math.isinf(high) else f"in [{low}, {high}]"
        raise ValueError(f"speculative_config: {key} must be a number {span}; got {value!r}")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative_config; build it with `from_dict`. The fields of the other method
    are None; every field of this one holds its resolved value."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    # vLLM's option: no drafts while more rows than this run (None: drafts at any batch size).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}; "
                f"got {self.method!r}"
            )
        for key in METHOD_KEYS[self.method]:
            if getattr(self, key) is None:
                raise ValueError(
                    f"speculative_config: {key} is required for method {self.method!r}"
                )
        for method, keys in METHOD_KEYS.items():
            for key in keys:
                if method != self.method and getattr(self, key) is not None:
                    raise ValueError(
                        f"speculative_config: {key} applies to method {method!r}, "
                        f"not {self.method!r}"
                    )
        if self.method == "ngram":
            low = _integer("prompt_lookup_min", self.prompt_lookup_min, 1)
            high = _integer("prompt_lookup_max", self.prompt_lookup_max, 1)
            if low > high:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min ({low}) must be <= "
                    f"prompt_lookup_max ({high})"
                )
        else:
            _integer("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
            _integer(
                "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
            )
            _number(
                "suffix_decoding_max_spec_factor",
                self.suffix_decoding_max_spec_factor,
                0.0,
                math.inf,
            )
            _number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0, 1)
        # After the method's options: suffix's default copies max_tree_depth, named first.
        _integer("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.disable_by_batch_size is not None:
            _integer("disable_by_batch_size", self.disable_by_batch_size, 1)

    @classmethod
    def from_dict(cls, options: Mapping[str, object]) -> SpeculativeConfig:
        """vLLM's speculative_config dict -> a checked config with the defaults filled."""
        if not isinstance(options, Mapping):
            raise ValueError(
                f"speculative_config must be a mapping of options; got {type(options).__name__}"
            )
        known = {f.name for f in fields(cls)}
        for key in options:
            if key not in known:
                raise ValueError(
                    f"speculative_config: unknown key {key!r}; the keys are "
                    f"{', '.join(sorted(known))}"
                )
        if "method" not in options:
            raise ValueError(f"speculative_config: method is required ({', '.join(METHODS)})")
        method = options["method"]
        if method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(METHODS)}; got {method!r}"
            )
        values = dict(options)
        if method == "ngram":
            if "num_speculative_tokens" not in values:
                raise ValueError("speculative_config: num_speculative_tokens is required for ngram")
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            if low is None and high is None:
                low = high = NGRAM_DEFAULT_N
            # The given one is checked under its own name before the other copies it.
            low = None if low is None else _integer("prompt_lookup_min", low, 1)
            high = None if high is None else _integer("prompt_lookup_max", high, 1)
            values["prompt_lookup_min"] = high if low is None else low
            values["prompt_lookup_max"] = low if high is None else high
        else:
            values = {**SUFFIX_DEFAULTS, **values}
            if values.get("num_speculative_tokens") is None:
                values["num_speculative_tokens"] = values["suffix_decoding_max_tree_depth"]
        return cls(**values)  # type: ignore[arg-type]


def build_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter of config.method, empty; the engine caps each call's k at
    config.num_speculative_tokens."""
    if config.method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.suffix_decoding_max_tree_depth is not None
    assert config.suffix_decoding_max_cached_requests is not None
    assert config.suffix_decoding_max_spec_factor is not None
    assert config.suffix_decoding_min_token_prob is not None
    return SuffixDrafter(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob,
    )
