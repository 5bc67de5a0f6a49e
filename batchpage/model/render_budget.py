"""The budget of one chat-template render: limits, what is charged, and size predictions.

`chat_render` charges every value a template makes and every loop step it takes to one
`RenderBudget`, and asks it to predict the size of a value *before* an operation makes it (a
string times 3e9 is refused, never allocated). Sizes are in characters for text, elements for
containers and decimal digits for integers; work is the sum of the sizes made (containers at 8
units an element, their least cost in memory) plus one unit a loop step and the literal text
each step writes, so the work budget bounds both the time and the memory of a render.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2.runtime import Undefined
from jinja2.utils import Namespace

_FORMAT_NUMBER = re.compile(r"\d+")
_CONTAINER_UNITS = 8


@dataclass(frozen=True)
class RenderLimits:
    """max_chars: the rendered text, and any one value made on the way (characters; elements
    of a list; digits of an integer). max_work: everything made and every loop step of one
    render together (None: 8 x max_chars + 1M). timeout_s: wall time of one render."""

    max_chars: int = 4 << 20
    max_work: int | None = None
    timeout_s: float = 5.0

    @property
    def work(self) -> int:
        return self.max_work if self.max_work is not None else 8 * self.max_chars + (1 << 20)


class TemplateLimitError(ValueError):
    """A chat template went past its RenderLimits; the message says which limit and where."""


class RenderBudget:
    """One render's account. Holds no public attribute a template could reach: the sandbox
    refuses underscore names."""

    __slots__ = ("_deadline", "_limits", "_loop_text", "_work")

    def __init__(self, limits: RenderLimits, loop_text: int = 0) -> None:
        self._limits = limits
        self._work = 0
        self._deadline = time.monotonic() + limits.timeout_s
        self._loop_text = loop_text  # the most literal text one step of a loop writes

    def _charge(self, units: int) -> None:
        self._work += units
        if self._work > self._limits.work:
            raise TemplateLimitError(
                f"the chat template did more than {self._limits.work:,} units of work "
                "(loop steps and text made) for one prompt"
            )
        if time.monotonic() > self._deadline:
            raise TemplateLimitError(
                f"the chat template ran longer than {self._limits.timeout_s:g} s for one prompt"
            )

    def _allow(self, size: int, what: str) -> None:
        """Refuse a value of `size` before it is made."""
        if size > self._limits.max_chars:
            raise TemplateLimitError(
                f"the chat template's {what} would make a value of {size:,} characters or "
                f"elements, over the limit of {self._limits.max_chars:,}"
            )

    def _made(self, value: Any, what: str) -> Any:
        """Charge a value just made (and refuse it if it is too big to go further)."""
        size, units = _size(value)
        self._allow(size, what)
        self._charge(units)
        return value

    def _iterate(self, iterable: Iterable[Any], per_step: int | None = None) -> Iterator[Any]:
        step = 1 + (self._loop_text if per_step is None else per_step)
        for item in iterable:
            self._charge(step)
            yield item

    def _check_ints(self, args: Iterable[Any], what: str) -> None:
        """Integers passed to a method or filter are widths and counts far more often than
        data: one over max_chars is refused (`'x'.ljust(10**9)`, `|indent(10**9)`)."""
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool):
                self._allow(abs(a), f"{what} argument")

    def _limit(self) -> int:
        return self._limits.max_chars


def _size(value: Any) -> tuple[int, int]:
    """(size, work units) of a value."""
    if isinstance(value, str):
        return len(value), len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return len(value), _CONTAINER_UNITS * len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        digits = int_digits(value)
        return digits, digits
    return 0, 1


def int_digits(value: int) -> int:
    return value.bit_length() * 30103 // 100000 + 1  # log10(2) = 0.30103


def text_size(value: Any, cap: int) -> int:
    """An upper bound of len(str(value)) (containers as their repr), found walking at most
    about `cap` units: the walk stops once the total is past cap."""
    total = 0
    stack = [value]
    seen: set[int] = set()
    while stack and total <= cap:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) if v is value else _repr_len(v)
        elif isinstance(v, Undefined):
            continue
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += int_digits(v) + 1
        elif isinstance(v, float):
            total += 24
        elif isinstance(v, (Mapping, list, tuple, set, frozenset, Namespace)):
            if id(v) in seen:  # a namespace holding itself: repr prints it once
                total += 8
                continue
            seen.add(id(v))
            items = v._Namespace__attrs if isinstance(v, Namespace) else v  # type: ignore[attr-defined]
            if isinstance(items, Mapping):
                total += 2 + 4 * len(items) + (13 if isinstance(v, Namespace) else 0)
                for k, item in items.items():
                    stack.append(k)
                    stack.append(item)
            else:
                total += 2 + 2 * len(items)
                stack.extend(items)
        else:
            total += 100  # a macro, loop or cycler: its repr is short
    return total


def _repr_len(s: str) -> int:
    # repr escapes what is not printable, at most 10 characters for one (\U0010ffff).
    return len(s) + 2 if s.isprintable() else 10 * len(s) + 2


def format_size(fmt: str, args: Iterable[Any], cap: int) -> int:
    """An upper bound of the length of `fmt` formatted (str.format or %) with `args`: every
    field may hold the longest argument, padded to the widest width written in fmt or passed
    as an argument."""
    values = list(args)
    fields = fmt.count("{") + fmt.count("%")
    if not fields:
        return len(fmt)
    widest = max((int(n) for n in _FORMAT_NUMBER.findall(fmt[: cap + 1])), default=0)
    ints = [abs(a) for a in values if isinstance(a, int) and not isinstance(a, bool)]
    longest = max((text_size(a, cap) for a in values), default=0)
    return len(fmt) + fields * (longest + max(widest, *ints, 0))
