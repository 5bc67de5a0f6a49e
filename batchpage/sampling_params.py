"""SamplingParams: how to generate one request's completions (vLLM's names and defaults).

Every field is validated in ``__post_init__`` so that a bad value fails where it is created, with a
ValueError that names the field, the value and the allowed range. ``StructuredOutputsParams``
(vLLM's names) constrains the output to a JSON schema, a regex, a list of choices or an EBNF
grammar; the engine compiles it with xgrammar, so a schema or regex that xgrammar refuses is that
request's error, not a ValueError here. Per-row overrides from a dataset
go through :meth:`SamplingParams.replace`, which validates again and turns unknown names into a
ValueError too, so the job can record the row's error and carry on.

The dataclass is mutable like vLLM's; assigning to a field afterwards skips validation, so prefer
``replace``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from batchpage.json_depth import schema_depth_error

# The range torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# OpenAI's documented range for logit_bias values.
_MAX_LOGIT_BIAS = 100.0
_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _as_int(name: str, value: Any) -> int:
    # Dataset columns hand us numpy ints, or floats such as 32.0 when a column has nulls.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _as_bool(name: str, value: Any) -> bool:
    # Accept numpy.bool_ and 0/1 but not arbitrary truthy values such as "no".
    if isinstance(value, bool) or (isinstance(value, numbers.Integral) and value in (0, 1)):
        return bool(value)
    if type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


def _optional_int(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    value = _as_int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} or None, got {value}")
    return value


@dataclass
class StructuredOutputsParams:
    """Constrain the output; set exactly one kind (vLLM's StructuredOutputsParams):

    - json: a JSON schema (a dict, or its JSON text); the output is one JSON value matching it,
      laid out as ``json.dumps`` does (``{"a": 1, "b": [2, 3]}``);
    - regex: the whole output matches the regular expression;
    - choice: the output is exactly one of these strings;
    - grammar: an EBNF grammar with a ``root`` rule (xgrammar's GBNF dialect);
    - json_object=True: any JSON object.

    A constrained output ends when its grammar does: end-of-sequence is allowed only where the
    grammar is complete, so an output that finishes with "stop" is a complete match.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINT_KINDS)}; "
                f"got {', '.join(chosen) or 'none'}"
            )
        self.json_object = _as_bool("structured_outputs.json_object", self.json_object)
        if self.json is not None:  # before json.loads and json.dumps, which recurse
            too_deep = schema_depth_error(self.json, "structured_outputs.json")
            if too_deep:
                raise ValueError(too_deep)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON text: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {self.json!r:.80}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be non-empty text, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {choice!r}"
                )
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    f"structured_outputs.choice must hold non-empty strings, got {choice!r}"
                )
            self.choice = list(choice)

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: equal keys compile to the same grammar. Key
        order in a schema is kept, since it is the order of the output's properties."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return self.kind, text

    @classmethod
    def from_response_format(cls, value: Any) -> StructuredOutputsParams | None:
        """The constraint of an OpenAI ``response_format`` (a dict, or its JSON text):
        ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, ``{"type":
        "json_object"}``, or ``{"type": "text"}`` (None: no constraint). Raises ValueError
        naming what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"response_format is not valid JSON text: {e}") from None
            except RecursionError:
                raise ValueError("its schema is nested too deeply to read: flatten it") from None
        if not isinstance(value, dict):
            raise ValueError(f"response_format must be an object with a type, got {value!r:.80}")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind != "json_schema":
            raise ValueError(
                f"response_format type must be json_schema, json_object or text, got {kind!r}"
            )
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError(
                'response_format of type json_schema needs {"json_schema": {"schema": {...}}}'
            )
        return cls(json=schema)


@dataclass
class SamplingParams:
    """Generation settings for one request; see vLLM's SamplingParams for the meaning of each."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (0: the chosen one only)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None  # None: n (see effective_beam_width)
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never" (HF's beam-search semantics)
    structured_outputs: StructuredOutputsParams | None = None
    # With a reasoning parser: at most this many thinking tokens, then the end of thinking is
    # forced and the answer follows (batchpage/engine/reasoning.py). None: no limit.
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_sampling()
        self._check_penalties()
        self._check_stops()
        self._check_outputs()
        self._check_beam_search()
        self._check_structured_outputs()

    # -- validation, one group of fields per method ------------------------------------------------

    def _check_counts(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self.best_of = _optional_int("best_of", self.best_of, 1)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        self.max_tokens = _optional_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        self.thinking_token_budget = _optional_int(
            "thinking_token_budget", self.thinking_token_budget, 0
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _check_sampling(self) -> None:
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0  # one spelling of "off" downstream
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1] or None, got {self.seed}")
        if self.best_of is not None and self.best_of > 1 and self.is_greedy:
            raise ValueError(f"best_of must be 1 with greedy sampling, got {self.best_of}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}"
                )
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                # JSON and YAML give string keys; accept "42" as token 42.
                token_id = _as_int(
                    "logit_bias key", int(token) if isinstance(token, str) else token
                )
                if token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id}")
                value = _as_float(f"logit_bias[{token_id}]", value)
                if abs(value) > _MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {value}")
                bias[token_id] = value
            self.logit_bias = bias or None

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError(f"stop must not contain an empty string, got {stop!r}")
        self.stop = list(stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = [_as_int("stop_token_ids", t) for t in ids]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )

    def _check_outputs(self) -> None:
        self.logprobs = _optional_int("logprobs", self.logprobs, 0)
        self.prompt_logprobs = _optional_int("prompt_logprobs", self.prompt_logprobs, 0)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)

    def _check_beam_search(self) -> None:
        self.use_beam_search = _as_bool("use_beam_search", self.use_beam_search)
        self.beam_width = _optional_int("beam_width", self.beam_width, 1)
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        if self.early_stopping != "never":
            self.early_stopping = _as_bool("early_stopping", self.early_stopping)
        if not self.use_beam_search:
            # As vLLM did: beam-only knobs without beam search are a misconfiguration.
            if self.beam_width is not None:
                raise ValueError(f"beam_width requires use_beam_search=True, got {self.beam_width}")
            if self.length_penalty != 1.0:
                raise ValueError(
                    f"length_penalty must be 1.0 without use_beam_search, got {self.length_penalty}"
                )
            if self.early_stopping is not False:
                raise ValueError(
                    f"early_stopping must be False without use_beam_search, "
                    f"got {self.early_stopping!r}"
                )
            return
        if self.thinking_token_budget is not None:
            raise ValueError(
                "thinking_token_budget cannot be combined with use_beam_search: beams are "
                "ranked on whole outputs, so a forced end of thinking would bias them"
            )
        if self.beam_width is not None and self.beam_width < self.n:
            raise ValueError(f"beam_width must be >= n ({self.n}), got {self.beam_width}")
        # Beam search ranks by the model's log-probs; sampling knobs would be silently ignored.
        if self.temperature not in (0.0, 1.0):
            raise ValueError(
                f"temperature must be 0 or 1 (unused) with use_beam_search, got {self.temperature}"
            )
        if self.top_k != 0 or self.top_p != 1.0 or self.min_p != 0.0:
            raise ValueError(
                "top_k, top_p and min_p must be off with use_beam_search, got "
                f"top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}"
            )

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):  # e.g. {"json": schema} from a config or JSON file
            unknown = sorted(set(so) - set(_CONSTRAINT_KINDS))
            if unknown:
                raise ValueError(
                    f"structured_outputs has unknown key(s) {unknown}; "
                    f"known: {', '.join(_CONSTRAINT_KINDS)}"
                )
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        # The grammar decides where a constrained output ends; these would contradict it.
        if self.ignore_eos:
            raise ValueError(
                "ignore_eos must be False with structured_outputs: the output ends where its "
                "grammar does"
            )
        if self.min_tokens:
            raise ValueError(
                f"min_tokens must be 0 with structured_outputs (the grammar decides the length), "
                f"got {self.min_tokens}"
            )

    # -- derived views ---------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature 0 or top_k 1 (both leave one candidate)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to apply to the logits first and no logprobs to report: the
        token is the argmax of the raw logits (the sampler's hot path)."""
        return (
            self.is_greedy
            and not self.logit_bias
            and not self.min_tokens
            and self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and self.logprobs is None
        )

    @property
    def effective_beam_width(self) -> int:
        """Beams kept per step under beam search: beam_width, or n when it is not set."""
        return self.beam_width if self.beam_width is not None else self.n

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ValueError when a token id in the params is outside the model's vocabulary.

        Call it when a request is admitted: the sampler indexes logits with these ids.
        """
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ValueError(f"{name} token ids must be < vocab size {vocab_size}, got {bad}")

    def replace(self, **overrides: Any) -> SamplingParams:
        """A validated copy with some fields changed (per-row overrides)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s) {unknown}; known: {sorted(names)}")
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search parameters (LLM.beam_search): beam_width beams kept a step, each up
    to max_tokens. Beams are ranked by their summed logprobs over their length **
    length_penalty, as HF ranks them; temperature must be 0 (the model's own logprobs)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """The same search as SamplingParams(use_beam_search=True, ...): every beam returned."""
        if self.temperature != 0.0:
            raise ValueError(
                f"BeamSearchParams.temperature={self.temperature}: beams are ranked by the "
                "model's logprobs; set temperature=0"
            )
        # Checked here, by its own name: it becomes both n and beam_width below, and
        # SamplingParams would name n, which this caller never gave.
        width = _as_int("BeamSearchParams.beam_width", self.beam_width)
        if width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be >= 1, got {width}")
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            beam_width=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            temperature=0.0,
        )
