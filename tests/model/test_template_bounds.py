"""Chat templates render within bounds: the same text as transformers for ordinary templates,
and for hostile ones (string doubling in a loop, 'x' * 3e9, nested range loops, huge widths
and joins) TemplateLimitError within the time limit and a small memory peak, never more; a
hypothesis fuzz of template fragments holds the same."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchpage.model.chat_render import CompiledTemplate
from batchpage.model.render_budget import RenderLimits, TemplateLimitError
from batchpage.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "templates"
CHATS = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is a radix tree?"},
        {"role": "assistant", "content": "A compressed trie."},
        {"role": "user", "content": "And a paged cache? é ü 中文"},
    ],
]
SMALL = RenderLimits(max_chars=100_000, timeout_s=1.0)
# A render may pass its deadline by one operation on a value of at most max_chars: this
# leaves room for a loaded machine, and is still far from what an unbounded render takes.
SLACK_S = 3.0
PEAK_BYTES = 64 << 20


def bounded(source: str, limits: RenderLimits = SMALL) -> tuple[str | None, float, int]:
    """(text or None when refused, seconds, peak bytes allocated) of one render."""
    template = CompiledTemplate(source)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        text: str | None = template.render(limits, {"messages": CHATS[0]})
    except TemplateLimitError:
        text = None
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return text, elapsed, peak


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.jinja")))
@pytest.mark.parametrize(
    "kwargs", [{}, {"enable_stats": True, "show_words": True}, {"enable_thinking": False}]
)
def test_templates_render_as_transformers_renders_them(tokenizer, name: str, kwargs) -> None:
    source = (TEMPLATES / name).read_text()
    ours = Tokenizer(tokenizer)
    for chat in CHATS:
        want = tokenizer.apply_chat_template(
            chat, chat_template=source, add_generation_prompt=True, tokenize=False, **kwargs
        )
        got = ours.render_chat_template(chat, chat_template=source, chat_template_kwargs=kwargs)
        assert got == want
    bad = [{"role": "assistant", "content": "x"}]
    if "raise_exception" in source:  # the template's own refusal stays the template's error
        with pytest.raises(jinja2.TemplateError, match="must alternate"):
            ours.render_chat_template(bad, chat_template=source)


HOSTILE = {
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(99) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "doubling_join": "{% set ns = namespace(s='x') %}{% for i in range(99) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "times_3e9": "{{ 'x' * 3000000000 }}",
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested_output": "{% for i in range(100000) %}{% for j in range(100000) %}ab{% endfor %}"
    "{% endfor %}",
    "power": "{{ 10 ** 100000000 }}",
    "ljust": "{{ 'x'.ljust(3000000000) }}",
    "center": "{{ 'x'|center(3000000000) }}",
    "format_width": "{{ '{:>3000000000}'.format('x') }}",
    "percent_width": "{{ '%3000000000s' % 'x' }}",
    "replace_empty": "{% set s = 'x' * 90000 %}{{ s|replace('', s) }}",
    "join_copies": "{% set s = 'x' * 90000 %}{{ ([s] * 90000)|join }}",
    "list_repr": "{% set s = 'x' * 90000 %}{{ [s] * 90000 }}",
    "indent": "{% set s = '\n' * 90000 %}{{ s|indent(90000) }}",
    "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "set_block": "{% set s = 'x' * 90000 %}{% set b %}{% for i in range(100000) %}{{ s }}"
    "{% endfor %}{% endset %}{{ b|length }}",
    "string_loops": "{% set s = 'x' * 90000 %}{% for a in s %}{% for b in s %}{% endfor %}"
    "{% endfor %}",
    "quadratic_sum": "{{ ([[1]] * 90000)|sum(start=[]) }}",
    "expandtabs": "{{ ('\t' * 90000).expandtabs(90000) }}",
    "tojson_indent": "{{ (range(90000)|list)|tojson(indent=90000) }}",
    "batch_fill": "{{ [1]|batch(3000000000, 'x')|list }}",
    "nested_format": "{{ '{0:{1}}{0:{1}}{0:{1}}{0:{1}}{0:{1}}'.format('', 90000) }}",
    "list_growth": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + ['x' * 90000] %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_refused_within_bounds(name: str) -> None:
    text, elapsed, peak = bounded(HOSTILE[name])
    assert text is None
    assert elapsed < SMALL.timeout_s + SLACK_S
    assert peak < PEAK_BYTES


def test_the_limits_say_which_was_passed() -> None:
    with pytest.raises(TemplateLimitError, match=r"'\*' would make a value of 3,000,000,000"):
        CompiledTemplate(HOSTILE["times_3e9"]).render(SMALL, {})
    # Which of work and time runs out first depends on the machine: each alone here.
    timed = RenderLimits(max_chars=100_000, max_work=10**15, timeout_s=0.5)
    with pytest.raises(TemplateLimitError, match=r"ran longer than 0.5 s"):
        CompiledTemplate(HOSTILE["nested_range"]).render(timed, {})
    worked = RenderLimits(max_chars=100_000, max_work=50_000, timeout_s=3600)
    with pytest.raises(TemplateLimitError, match="more than 50,000 units of work"):
        CompiledTemplate(HOSTILE["nested_range"]).render(worked, {})
    with pytest.raises(TemplateLimitError, match="text for one prompt is over 100,000"):
        CompiledTemplate("{% for i in range(9999) %}{{ 'y' * 99 }}{% endfor %}").render(SMALL, {})
    with pytest.raises(TemplateLimitError, match="recursed too deeply"):
        CompiledTemplate(HOSTILE["recursion"]).render(SMALL, {})


# --- fuzz ----------------------------------------------------------------------------------------

NUMBERS = st.sampled_from(["0", "1", "3", "1000", "100000", "3000000000", "-1"])
TEXTS = st.sampled_from(["'x'", "'ab\\n'", "s", "ns.s", "messages[0].content", "'{}%s'"])
FILTERS = st.sampled_from(["center", "indent", "truncate", "batch", "wordwrap", "round"])
METHODS = st.sampled_from(["ljust", "center", "zfill", "expandtabs", "split", "upper"])


def _expressions() -> st.SearchStrategy[str]:
    def grow(e: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        pair = st.tuples(e, e)
        return st.one_of(
            pair.map(lambda t: f"({t[0]} * {t[1]})"),
            pair.map(lambda t: f"({t[0]} + {t[1]})"),
            pair.map(lambda t: f"({t[0]} ~ {t[1]})"),
            pair.map(lambda t: f"({t[0]} ** {t[1]})"),
            pair.map(lambda t: f"({t[0]} % {t[1]})"),
            st.tuples(e, FILTERS, NUMBERS).map(lambda t: f"({t[0]}|{t[1]}({t[2]}))"),
            st.tuples(e, METHODS, NUMBERS).map(lambda t: f"({t[0]}).{t[1]}({t[2]})"),
            pair.map(lambda t: f"({t[0]}|replace('', {t[1]}))"),
            pair.map(lambda t: f"([{t[0]}] * {t[1]})|join({t[0]})"),
            pair.map(lambda t: f"'{{}}{{}}'.format({t[0]}, {t[1]})"),
            e.map(lambda x: f"[{x}, {x}]"),
        )

    return st.recursive(st.one_of(TEXTS, NUMBERS), grow, max_leaves=6)


def _statements() -> st.SearchStrategy[str]:
    expr = _expressions()
    leaf = st.one_of(
        expr.map(lambda x: "{{ " + x + " }}"),
        expr.map(lambda x: "{% set ns.s = " + x + " %}"),
        st.just("{{ ns.s }}"),
    )

    def grow(body: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(NUMBERS, body).map(
                lambda t: "{% for i in range(" + t[0] + ") %}" + t[1] + "{% endfor %}"
            ),
            st.tuples(body, body).map(lambda t: t[0] + t[1]),
            body.map(lambda b: "{% for c in ns.s %}" + b + "{% endfor %}"),
        )

    return st.recursive(leaf, grow, max_leaves=5)


FUZZ = RenderLimits(max_chars=20_000, timeout_s=0.3)


@settings(
    max_examples=40,
    deadline=10_000,  # ms; a render is bounded far below it (FUZZ.timeout_s + one step)
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_statements())
def test_fuzzed_templates_stay_within_bounds(body: str) -> None:
    source = "{% set ns = namespace(s='ab') %}{% set s = 'xyz' %}" + body
    template = CompiledTemplate(source)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        text = template.render(FUZZ, {"messages": CHATS[0]})
        assert len(text) <= FUZZ.max_chars
    except TemplateLimitError:
        pass
    except Exception:  # noqa: BLE001 (the template's own error, as transformers raises it:
        pass  # the row's error in a job; what is checked here is the time and memory taken)
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < FUZZ.timeout_s + SLACK_S, source
    assert peak < PEAK_BYTES, source
