"""Chat templates rendered within bounds of output, work and time, whatever the template does.

A chat template is code that comes with a model folder. transformers renders it in jinja2's
ImmutableSandboxedEnvironment, which stops escapes to Python but not a template that doubles a
string in a loop, multiplies one by 3e9 or nests range loops: a template of a hundred bytes can
take the machine's memory and time. This is the same sandbox, with transformers' globals and
filters and the same variables (so a template renders the same text), bounded on every path
that makes a value or does work, through one `RenderBudget` per render:
- the operators that can make a big value (* ** + % and ~), calls (str methods, macros) and
  filters are predicted and refused *before* they make a value over `max_chars`, and what they
  make is charged;
- every loop step is charged, with the literal text its body writes, and so is every `{{ }}`;
- each charge checks the deadline; the rendered text is counted as it streams out.
A template that goes past a limit raises TemplateLimitError (a ValueError) saying which; a
template too deeply recursive gives it too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from types import BuiltinMethodType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, pass_context
from jinja2.visitor import NodeTransformer

from batchpage.model.render_budget import (
    RenderBudget,
    RenderLimits,
    TemplateLimitError,
    format_size,
    int_digits,
    text_size,
)

_BUDGET = "__batchpage_render_budget__"  # a template variable that only the render sets
_ITER, _CONCAT = "batchpage_loop_step", "batchpage_concat"  # filters the compiler inserts
_STR_WIDTH = frozenset({"ljust", "rjust", "center", "zfill"})


class CompiledTemplate:
    """A chat template compiled for bounded rendering (compile once, render per prompt)."""

    def __init__(self, source: str) -> None:
        self.env = BoundedEnvironment()
        bounder = _Bounder()
        tree = bounder.visit(self.env.parse(source))
        tree.set_environment(self.env)
        self.loop_text = bounder.most
        self.template = self.env.from_string(tree)

    def render(self, limits: RenderLimits, variables: Mapping[str, Any]) -> str:
        """The rendered text; TemplateLimitError past `limits`, the template's own errors
        (jinja2.TemplateError, TypeError, ...) as they are."""
        budget = RenderBudget(limits, self.loop_text)
        pieces: list[str] = []
        total = 0
        try:
            for piece in self.template.generate(**variables, **{_BUDGET: budget}):
                total += len(piece)
                if total > limits.max_chars:
                    raise TemplateLimitError(
                        f"the chat template's text for one prompt is over {limits.max_chars:,} "
                        "characters"
                    )
                budget._charge(len(piece))
                pieces.append(piece)
        except RecursionError:
            raise TemplateLimitError("the chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateLimitError("the chat template ran out of memory") from None
        return "".join(pieces)


class _Bounder(NodeTransformer):
    """Routes every loop's iterable through the step filter (charged per step with the literal
    text of its body) and every `~` join through the bounded join. `most`: the most literal
    text of one loop body (charged per step of recursive loops, whose later levels the compiler
    iterates itself)."""

    def __init__(self) -> None:
        self.most = 0

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        text = sum(_literal_text(n) for n in node.body)
        self.most = max(self.most, text)
        node.iter = nodes.Filter(
            node.iter, _ITER, [nodes.Const(text)], [], None, None, lineno=node.lineno
        )
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(parts, _CONCAT, [], [], None, None, lineno=node.lineno)


def _literal_text(node: nodes.Node) -> int:
    own = len(node.data) if isinstance(node, nodes.TemplateData) else 0
    return own + sum(len(d.data) for d in node.find_all(nodes.TemplateData))


def _budget(context: Context) -> RenderBudget:
    budget = context.parent.get(_BUDGET)
    if not isinstance(budget, RenderBudget):
        raise TemplateLimitError("a bounded chat template was rendered without its budget")
    return budget


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment as transformers sets it up, with every operator, call and
    filter that can make a big value predicted and charged (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, loopcontrols],
            finalize=_finalize,
        )
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = _bounded_filter("tojson", _tojson)
        self.filters[_ITER] = _loop_step
        self.filters[_CONCAT] = _concat
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _template_namespace()

    def call_binop(self, context: Context, operator_: str, left: Any, right: Any) -> Any:
        budget = _budget(context)
        budget._allow(_binop_size(operator_, left, right, budget._limit()), f"'{operator_}'")
        return budget._made(super().call_binop(context, operator_, left, right), operator_)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget(__context)
        name = getattr(__obj, "__name__", type(__obj).__name__)
        budget._check_ints([*args, *kwargs.values()], f"{name}()")
        budget._allow(_call_size(__obj, args, kwargs, budget._limit()), f"{name}()")
        budget._charge(1)
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (budget._iterate(args[0]), *args[1:])
        result = super().call(__context, __obj, *args, **kwargs)
        return budget._made(result, f"{name}()")


def _binop_size(op: str, left: Any, right: Any, cap: int) -> int:
    """The size of left <op> right, predicted without computing it."""
    ints = tuple(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
    sized = tuple(isinstance(x, (str, list, tuple)) for x in (left, right))
    if op == "*":
        if sized[0] and ints[1]:
            return len(left) * max(right, 0)
        if ints[0] and sized[1]:
            return len(right) * max(left, 0)
        if all(ints):
            return int_digits(left) + int_digits(right)
    elif op == "**" and all(ints) and right > 0 and abs(left) > 1:
        return int_digits(left) * right
    elif op == "+" and all(sized):
        return len(left) + len(right)
    elif op == "%" and isinstance(left, str):
        values = right if isinstance(right, tuple) else (right,)
        if isinstance(right, Mapping):
            values = tuple(right.values())
        return format_size(left, values, cap)
    return 0


def _call_size(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cap: int) -> int:
    """The size of a str method's result where it can be far larger than the string."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(method, "__self__", None)
    if not isinstance(method, BuiltinMethodType) or not isinstance(owner, str):
        return 0
    values = [*args, *kwargs.values()]
    name = method.__name__
    if name in ("format", "format_map"):
        if name == "format_map" and args and isinstance(args[0], Mapping):
            values = list(args[0].values())
        return format_size(owner, values, cap)
    if name in _STR_WIDTH and args and isinstance(args[0], int):
        return max(len(owner), args[0])
    if name == "expandtabs":
        width = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t") * max(int(width), 0)
    if name == "replace" and len(args) >= 2:
        return _replace_size(owner, args[0], args[1], args[2] if len(args) > 2 else -1, cap)
    if name == "join" and args:
        return _join_size(owner, args[0], cap)
    return 0


def _replace_size(text: Any, old: Any, new: Any, count: Any, cap: int) -> int:
    text, old, new = str(text)[: cap + 1], str(old), str(new)
    times = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    return len(text) + times * max(len(new) - len(old), 0)


def _join_size(sep: Any, items: Any, cap: int) -> int:
    if not isinstance(items, (list, tuple, str, dict)):
        return 0  # a generator is charged as it is consumed
    total = len(str(sep)) * len(items)
    for item in items:
        total += text_size(item, cap)
        if total > cap:
            break
    return total


# --- filters -------------------------------------------------------------------------------------


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` with its result's size predicted (where it can outgrow its input) and charged."""
    passed = _PassArg.from_obj(func)

    @pass_context
    @functools.wraps(func)
    def bounded(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget(context)
        budget._check_ints([*args, *kwargs.values()], f"|{name}")
        budget._allow(_filter_size(name, value, args, kwargs, budget._limit()), f"|{name}")
        if passed is _PassArg.context:
            result = func(context, value, *args, **kwargs)
        elif passed is _PassArg.eval_context:
            result = func(context.eval_ctx, value, *args, **kwargs)
        elif passed is _PassArg.environment:
            result = func(context.environment, value, *args, **kwargs)
        else:
            result = func(value, *args, **kwargs)
        return budget._made(result, f"|{name}")

    bounded.jinja_pass_arg = _PassArg.context  # type: ignore[attr-defined]
    return bounded


def _filter_size(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> int:
    def arg(i: int, key: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name in ("center",):
        return max(text_size(value, cap), int(arg(0, "width", 80)))
    if name == "indent":
        width = arg(0, "width", 4)
        width = len(width) if isinstance(width, str) else int(width)
        text = str(value)[: cap + 1] if isinstance(value, str) else ""
        return text_size(value, cap) + (text.count("\n") + 1) * max(width, 0)
    if name == "wordwrap":
        width = max(int(arg(0, "width", 79)), 1)
        wrap = arg(2, "wrapstring", "\n")
        size = text_size(value, cap)
        return size + (size // width + 1) * len(str(wrap or "\n"))
    if name == "replace" and len(args) >= 2:
        return _replace_size(value, args[0], args[1], arg(2, "count", None), cap)
    if name == "join":
        return _join_size(arg(0, "d", ""), value, cap)
    if name == "format" and isinstance(value, str):
        return format_size(value, [*args, *kwargs.values()], cap)
    if name == "tojson":
        indent = arg(1, "indent", None)
        per_line = len(indent) if isinstance(indent, str) else int(indent or 0)
        return text_size(value, cap) * (1 + max(per_line, 0))
    if name in ("batch", "slice"):
        return int(arg(0, "linecount" if name == "batch" else "slices", 0))
    if name == "sum" and isinstance(arg(1, "start", 0), (list, tuple, str)):
        # Adding sequences copies the sum so far at each item: quadratic in the items.
        items = value if isinstance(value, (list, tuple)) else ()
        return _join_size("", items, cap) * max(len(items), 1) // 2
    if name in ("e", "escape", "forceescape", "urlize", "string", "pprint", "safe", "list"):
        return text_size(value, cap) * (6 if name in ("e", "escape", "forceescape") else 1)
    return 0


@pass_context
def _loop_step(context: Context, iterable: Any, text: int) -> Any:
    return _budget(context)._iterate(iterable, text)


@pass_context
def _concat(context: Context, parts: list[Any]) -> str:
    budget = _budget(context)
    size = sum(text_size(p, budget._limit()) for p in parts)
    budget._allow(size, "'~'")
    return budget._made("".join(map(str, parts)), "'~'")


@pass_context
def _finalize(context: Context, value: Any) -> Any:
    """Every `{{ }}` output: a value whose text would be too long is refused before str()."""
    budget = _budget(context)
    size = text_size(value, budget._limit())
    budget._allow(size, "output")
    budget._charge(size)
    return value if value is not None else ""


# --- transformers' additions to the sandbox, the same names and behaviour ------------------------


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' tag for the
    assistant-token mask, which batchpage does not need)."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, json.dumps' options
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the dict type itself (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> type:
    """jinja2's namespace refusing underscore names (transformers' TemplateNamespace)."""

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace
