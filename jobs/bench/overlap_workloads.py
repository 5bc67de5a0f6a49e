"""High-overlap prompt sets for speculative decoding (issue #71), built deterministically (a seed,
no downloads): answers that copy most of their prompt, the case where drafted tokens are right.

- rename: small Python functions, each to be returned with one identifier renamed;
- extract: short synthetic customer records, some of their fields to be returned as JSON.

Each row goes through the model's chat template (the ids LLM.chat would build; a tokenizer
without a template gets the user turn's text alone). Each row's max_tokens is its reference
answer's length plus a margin, so a model that answers right stops at its end-of-turn, one that
adds a few tokens (a code fence's language, a blank line) is not cut short.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobs.bench.workloads import ChatTokenizer, Workload

NAMES = ("rename", "extract")
MARGIN_TOKENS = 8  # generated past the reference answer's length before a row is cut

# Function bodies: {f} the function's name, {a}..{e} its identifiers (distinct words).
FUNCTIONS = (
    "def {f}({a}, {b}):\n    {c} = []\n    for {d} in {a}:\n        if {d} > {b}:\n"
    "            {c}.append({d} * 2)\n    return {c}\n",
    "def {f}({a}):\n    {b} = {{}}\n    for {c} in {a}:\n        {b}[{c}] = {b}.get({c}, 0) + 1\n"
    "    return {b}\n",
    "def {f}({a}, {b}=0):\n    {c} = {b}\n    for {d}, {e} in enumerate({a}):\n"
    "        {c} += {d} * {e}\n    return {c}\n",
    "def {f}({a}, {b}):\n    {c} = {a}.strip().split({b})\n"
    "    {d} = [{e}.lower() for {e} in {c} if {e}]\n    return {b}.join({d})\n",
    "def {f}({a}, {b}):\n    {c}, {d} = 0, len({a}) - 1\n    while {c} <= {d}:\n"
    "        {e} = ({c} + {d}) // 2\n        if {a}[{e}] < {b}:\n            {c} = {e} + 1\n"
    "        else:\n            {d} = {e} - 1\n    return {c}\n",
    "def {f}({a}):\n    {b} = None\n    {c} = 0\n    for {d} in {a}:\n"
    "        if {b} is None or {d} > {b}:\n            {b} = {d}\n            {c} += 1\n"
    "    return {b}, {c}\n",
)
# Identifiers and function-name parts are disjoint, and neither holds a name the bodies call
# (len, enumerate, append, ...), so a whole-word rename touches the one identifier only.
IDENTIFIERS = (
    "values", "limit", "result", "item", "total", "count", "scores", "threshold", "names",
    "prefix", "words", "index", "record", "data", "number", "low", "high", "middle", "best",
    "size", "text", "parts", "token", "weight", "offset", "entry", "seen", "target", "step",
    "value", "acc", "current", "row", "column", "buffer", "chunk", "amount", "sep", "level",
)  # fmt: skip
VERBS = ("filter", "tally", "weigh", "merge", "find", "scale", "clean", "pick", "rank", "peak")
NOUNS = ("orders", "events", "rows", "grades", "tags", "samples", "prices", "lines", "visits")

FIRST = ("Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kemal", "Laura", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa")  # fmt: skip
LAST = ("Moreau", "Silva", "Novak", "Okafor", "Lindqvist", "Tanaka", "Romero", "Keller",
        "Haddad", "Costa", "Petrov", "Nguyen", "Fischer", "Dubois")  # fmt: skip
CITIES = ("Lyon", "Porto", "Krakow", "Lagos", "Uppsala", "Osaka", "Valencia", "Graz", "Beirut",
          "Curitiba", "Tartu", "Da Nang", "Leipzig", "Nantes")  # fmt: skip
JOBS = ("nurse", "welder", "teacher", "data analyst", "pharmacist", "architect", "baker",
        "pilot", "translator", "electrician")  # fmt: skip
COMPANIES = ("Northwind Ltd", "Blue Harbor", "Acme Foods", "Kestrel Labs", "Orchid Health",
             "Granite Works", "Sundial Media")  # fmt: skip
PLANS = ("basic", "standard", "premium", "family", "student")


@dataclass(frozen=True)
class OverlapWorkload:
    """A workload and each row's reference answer (what a model that does the task writes)."""

    workload: Workload
    answers: list[str]


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", True))


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the chat template, as LLM.chat builds it; a tokenizer without a
    template (the random-weight models'): the text encoded alone."""
    if has_template(tokenizer):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return list(tokenizer.encode(text))


def _rename_row(rng: random.Random) -> tuple[str, str]:
    body = rng.choice(FUNCTIONS)
    words = rng.sample(IDENTIFIERS, 6)
    slots = dict(zip("abcde", words, strict=False))
    used = [slots[s] for s in "abcde" if "{" + s + "}" in body]
    old, new = rng.choice(used), words[5]
    code = body.format(f=f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}", **slots)
    renamed = re.sub(rf"\b{old}\b", new, code)
    prompt = (f"Rewrite this function renaming `{old}` to `{new}`. Return only the code.\n\n"
              f"```python\n{code}```")  # fmt: skip
    return prompt, f"```python\n{renamed}```"


def _record(rng: random.Random) -> tuple[list[tuple[str, str, Any]], int]:
    """A customer record's (label, JSON key, value) lines and its number."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    joined = f"{rng.randint(2012, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    phone = f"+{rng.randint(30, 49)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    lines = [
        ("Full name", "name", f"{first} {last}"), ("Age", "age", rng.randint(19, 78)),
        ("City", "city", rng.choice(CITIES)), ("Occupation", "occupation", rng.choice(JOBS)),
        ("Employer", "company", rng.choice(COMPANIES)),
        ("E-mail", "email", f"{first.lower()}.{last.lower()}@example.com"),
        ("Phone", "phone", phone), ("Member since", "joined", joined),
        ("Plan", "plan", rng.choice(PLANS)),
    ]  # fmt: skip
    return lines, rng.randint(1000, 9999)


def _extract_row(rng: random.Random) -> tuple[str, str]:
    lines, number = _record(rng)
    asked = sorted(rng.sample(range(len(lines)), rng.randint(3, 5)))
    keys = [lines[i][1] for i in asked]
    record = "\n".join(f"{label}: {value}" for label, _, value in lines)
    prompt = (f"Extract these fields from the record as a JSON object with exactly these keys, "
              f"in this order: {', '.join(keys)}. Return only the JSON.\n\n"
              f"Customer record #{number}\n{record}")  # fmt: skip
    # Indented: the form a small chat model writes JSON in, so max_tokens fits its answer.
    return prompt, json.dumps({lines[i][1]: lines[i][2] for i in asked}, indent=2)


ROWS: dict[str, tuple[Callable[[random.Random], tuple[str, str]], str]] = {
    "rename": (_rename_row, "small Python functions, each returned with one identifier renamed"),
    "extract": (_extract_row, "short customer records, 3-5 given fields returned as JSON"),
}


def overlap_workload(name: str, tokenizer: ChatTokenizer, n: int, seed: int = 0) -> OverlapWorkload:
    """n rows of workload `name` (NAMES), the same for the same seed; each row's max_tokens is
    its reference answer's tokens plus MARGIN_TOKENS."""
    make, what = ROWS[name]
    rng = random.Random(f"{name}-{seed}")
    rows = [make(rng) for _ in range(n)]
    prompts = [chat_ids(tokenizer, prompt) for prompt, _ in rows]
    lengths = [len(tokenizer.encode(answer, add_special_tokens=False)) for _, answer in rows]
    template = "chat template" if has_template(tokenizer) else "no chat template: the text alone"
    workload = Workload(
        f"{name}-{n}",
        f"{n} {what} ({template}; max_tokens the reference answer's length + {MARGIN_TOKENS})",
        prompts,
        [m + MARGIN_TOKENS for m in lengths],
    )
    return OverlapWorkload(workload, [answer for _, answer in rows])


def _unfenced(text: str) -> str:
    text = text.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text.removesuffix("```").strip()


def answer_right(output: str, answer: str) -> bool:
    """Whether a model's output is the reference answer: the same code (code fences and the
    whitespace around them aside) or the same JSON object."""
    got, want = _unfenced(output), _unfenced(answer)
    if got == want:
        return True
    try:
        return json.loads(got) == json.loads(want)
    except ValueError:
        return False
