"""The code in an instruct model's reply to a HumanEval-style prompt, ready for the checker.

lm-eval's instruct variants take the reply up to its first fence; evalplus's sanitizer takes the
code block and keeps the definitions the entry point needs. Here, in that spirit:

1. The places code may be, in order: the ```python blocks, the untagged ``` blocks, the text
   before the first fence (a reply that went on with the prompt's code and then closed the
   fence; the whole reply when it has no fence). A block left open (the reply hit max_tokens)
   runs to the end of the reply. The first that defines the entry point wins, else the first
   that holds code at all.
2. It is cut to its longest run of whole lines that parses (a reply cut mid-line), past any
   leading prose.
3. If it defines the entry point at top level, it is the whole solution: only its imports,
   functions, classes and assignments are kept; example calls, prints, asserts and
   `if __name__ == "__main__":` blocks are dropped, as they may fail or never end.
4. Otherwise it is the function's body: a repeated signature line is dropped and the rest is
   indented under the prompt's signature.
5. A reply without code gives "" (the checker then fails it).
"""

from __future__ import annotations

import ast
import re
import textwrap

FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.M | re.S)
PYTHON_TAGS = {"python", "python3", "py"}
CODE_START = re.compile(r"(?:async[ \t]+def|def|class|import|from)[ \t]|@")
KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
KEPT_ASSIGNMENTS = (ast.Assign, ast.AnnAssign)
BODY_INDENT = "    "  # HumanEval's prompts are top-level functions indented by four spaces


def function_start(code: str, name: str) -> int | None:
    """Where `code` defines `name` at top level, if it does."""
    found = re.search(rf"^(?:async[ \t]+)?def[ \t]+{re.escape(name)}[ \t]*\(", code, re.M)
    return None if found is None else found.start()


def entry_point_of(prompt: str) -> str | None:
    """The function a HumanEval-style prompt asks for: its last top-level definition (helpers
    come before it)."""
    names = re.findall(r"^(?:async[ \t]+)?def[ \t]+(\w+)", prompt, re.M)
    return names[-1] if names else None


def defines_function(code: str, name: str) -> bool:
    """Whether `code` defines `name` at top level (then it is a whole solution, not a body)."""
    return function_start(code, name) is not None


def extract_code(reply: str, entry_point: str) -> str:
    """The solution in `reply`: a whole solution defining `entry_point`, a body to append to the
    prompt, or "" when the reply holds no code."""
    signature = re.compile(rf"[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}\b.*\n?")
    texts = []
    for text in _candidates(reply):
        texts.append(text)
        repeated = signature.match(text.lstrip("\n"))
        if repeated:  # the signature again, over a body that may not parse under it
            texts.append(text.lstrip("\n")[repeated.end() :])
    codes = [code for code in map(_parseable_prefix, texts) if code]
    whole = [code for code in codes if defines_function(code, entry_point)]
    if whole:
        return _definitions(whole[0])
    if not codes:
        return ""
    body = textwrap.dedent(codes[0]).strip("\n")
    return textwrap.indent(body, BODY_INDENT) + "\n"


def _candidates(reply: str) -> list[str]:
    blocks = [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(reply)]
    python = [text for tag, text in blocks if tag in PYTHON_TAGS]
    untagged = [text for tag, text in blocks if not tag]
    first_fence = reply.find("```")
    before = reply if first_fence < 0 else reply[:first_fence]
    return [*python, *untagged, before]


def _parseable_prefix(text: str) -> str:
    """The longest run of whole lines that parses and does something ("" if none), starting at
    the first line or, past leading prose, at a line that opens a definition or an import."""
    lines = textwrap.dedent(text).rstrip().splitlines()
    starts = [0, *(i for i, line in enumerate(lines) if i and CODE_START.match(line))]
    for start in starts:
        for end in range(len(lines), start, -1):
            code = "\n".join(lines[start:end])
            try:
                tree = ast.parse(code)
            except (SyntaxError, ValueError):
                continue
            if any(not _is_prose(node) for node in tree.body):
                return code + "\n"
    return ""


def _is_prose(node: ast.stmt) -> bool:
    """A lone word or string: what a sentence like "Sure" or a docstring parses as."""
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Name | ast.Constant)


def _definitions(code: str) -> str:
    """The imports, functions, classes and assignments of a whole solution, in order."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code  # the checker reports the error
    lines = code.splitlines()
    kept = []
    for node in tree.body:
        if isinstance(node, KEPT + KEPT_ASSIGNMENTS):
            decorators = getattr(node, "decorator_list", [])
            first = min([node.lineno, *(d.lineno for d in decorators)])
            kept.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "\n\n".join(kept) + "\n"
