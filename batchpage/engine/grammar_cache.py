"""GrammarCache: compiles structured-output constraints with xgrammar, once per distinct one.

One cache per engine, since a compiled grammar is tied to the tokenizer and the model's vocab
(the logits' width, which may exceed the tokenizer's: the extra ids are never allowed). Entries
are keyed by the constraint's content (StructuredOutputsParams.key), so a job whose rows share a
schema compiles it once; a constraint that xgrammar refuses is remembered as its error, so a bad
schema repeated over many rows is not compiled again either.

A JSON schema nested more than MAX_SCHEMA_DEPTH levels (batchpage/json_depth.py) is refused
before xgrammar sees it.

JSON schemas compile without free whitespace (xgrammar's any_whitespace=False): the output is
laid out as json.dumps does. With free whitespace, a small model can fill its whole budget with
spaces and newlines that the grammar has to allow.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

import xgrammar as xgr

from batchpage.json_depth import schema_depth_error
from batchpage.sampling_params import StructuredOutputsParams

# Distinct constraints kept compiled (each is tens of KiB); the least recently used goes first.
DEFAULT_CAPACITY = 512
# xgrammar's C++ errors start with a timestamp and a source location: "[12:00:00] x.cc:94: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCache:
    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_ids: Collection[int],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """``vocab_size``: the model's (the logits' width); ``eos_ids``: the tokens that end a
        sequence, which a grammar allows only where it is complete."""
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.capacity = capacity
        self._compiler: xgr.GrammarCompiler | None = None  # built for the first constraint
        self._entries: OrderedDict[tuple[str, str], xgr.CompiledGrammar | str] = OrderedDict()
        self.compilations = 0  # how many times xgrammar compiled (cache misses)

    def compile(self, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar; raises ValueError naming the problem when xgrammar refuses it."""
        if constraint.json is not None:  # before its key: json.dumps recurses
            too_deep = schema_depth_error(constraint.json, "structured_outputs.json")
            if too_deep:
                raise ValueError(too_deep)
        key = constraint.key
        entry = self._entries.get(key)
        if entry is None:
            entry = self._compile(constraint)
            self.compilations += 1
            self._entries[key] = entry
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry

    def _compile(self, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar | str:
        compiler = self._get_compiler()
        kind = constraint.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(constraint.key[1], any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(constraint.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(constraint.choice or []))
            return compiler.compile_grammar(constraint.grammar)
        except (RuntimeError, ValueError) as e:
            return f"structured_outputs.{kind} is invalid: {xgrammar_message(e)}"

    def _get_compiler(self) -> xgr.GrammarCompiler:
        # Reading the vocabulary takes about a second for 50k tokens: only constrained runs pay.
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._hf_tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.eos_ids or None,
            )
            # This cache is the only one: xgrammar's own would hold every entry a second time.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def check_constraint(constraint: StructuredOutputsParams) -> None:
    """Raise ValueError (as GrammarCache.compile would) when xgrammar cannot parse the
    constraint: parsing needs no tokenizer, so a job checks its own before the model loads."""
    if constraint.json is not None:
        too_deep = schema_depth_error(constraint.json, "structured_outputs.json")
        if too_deep:
            raise ValueError(too_deep)
    kind = constraint.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(constraint.key[1], any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(constraint.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(constraint.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(constraint.choice or []))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{kind} is invalid: {xgrammar_message(e)}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the given strings. JSON string escapes are
    also EBNF's, so json.dumps quotes each string safely (quotes, backslashes, newlines)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error as one line, without its C++ timestamp and source location."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(error).__name__
