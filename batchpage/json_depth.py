"""How deep objects and arrays nest in JSON, counted without recursion: a schema nested deeper
than MAX_SCHEMA_DEPTH is refused before anything recurses over it (json.loads and json.dumps give
up near a thousand levels) or compiles it (xgrammar's compile time grows steeply with depth)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Objects and arrays inside one another in a schema (an object property is two: the object and
# its properties).
MAX_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[][{}]")


def nesting_depth(value: Any) -> int:
    """How deep objects and arrays nest in `value`: JSON text, or the dicts and lists json.loads
    makes of it. Counted without recursion, so any depth is measured."""
    if isinstance(value, str):
        depth = deepest = 0
        for bracket in _BRACKET.findall(_JSON_STRING.sub("", value)):
            depth += 1 if bracket in "[{" else -1
            deepest = max(deepest, depth)
        return deepest
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            item = item.values()
        elif not isinstance(item, (list, tuple)):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in item)
    return deepest


def schema_depth_error(schema: Any, what: str) -> str | None:
    """The error for a schema (JSON text or its value) nested deeper than MAX_SCHEMA_DEPTH;
    None when it is within the bound."""
    depth = nesting_depth(schema)
    if depth <= MAX_SCHEMA_DEPTH:
        return None
    return (
        f"{what} nests objects and arrays {depth} levels deep, over the limit of "
        f"{MAX_SCHEMA_DEPTH}: flatten the schema"
    )
