"""Code from instruct replies shaped like the ones small chat models give to HumanEval prompts."""

from __future__ import annotations

import pytest

from batchpage.humaneval.code_extract import defines_function, extract_code

FULL_DEF = """\
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1 :]:
            if abs(a - b) < threshold:
                return True
    return False
"""

# Kept definitions are joined by one blank line.
SOLUTION = FULL_DEF.replace("\n\n\n", "\n\n")

FENCED_WITH_PROSE = f"""\
Sure! Here is the completed function:

```python
{FULL_DEF}

# Example usage
print(has_close_elements([1.0, 2.0, 3.0], 0.5))
assert has_close_elements([1.0, 2.8, 3.0], 0.3)
if __name__ == "__main__":
    import doctest
    doctest.testmod()
```

This function compares every pair of numbers and returns True as soon as two are closer than
the threshold. Its time complexity is O(n^2).
"""


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        pytest.param(FENCED_WITH_PROSE, SOLUTION, id="fenced-with-prose-and-examples"),
        pytest.param(FULL_DEF + "\n\nThis checks each pair.", SOLUTION, id="unfenced-full-def"),
        pytest.param("Here is the function:\n\n" + FULL_DEF, SOLUTION, id="unfenced-after-prose"),
        pytest.param(
            "```bash\npip install numpy\n```\n\n```\n" + FULL_DEF + "```\n",
            SOLUTION,
            id="untagged-block-after-a-shell-block",
        ),
        pytest.param(
            "```python\nprint(has_close_elements([1.0], 0.5))\n```\n\n```python\n"
            + FULL_DEF
            + "```",
            SOLUTION,
            id="the-block-that-defines-it-wins",
        ),
        pytest.param(
            "```python\n" + FULL_DEF + "\nprint(has_close_elements([1.0, 2.0], 0.5))\n"
            "print(has_close_elements('((()()()()(()",
            SOLUTION,
            id="open-block-cut-by-max-tokens",
        ),
        pytest.param(
            "```python\n    for i, a in enumerate(numbers):\n        if a > threshold:\n"
            "            return True\n    return False\n```",
            "    for i, a in enumerate(numbers):\n        if a > threshold:\n"
            "            return True\n    return False\n",
            id="fenced-body",
        ),
        pytest.param(
            "return sorted(numbers) != numbers\n```\n\nThe function returns whether ...",
            "    return sorted(numbers) != numbers\n",
            id="continued-body-then-closing-fence",
        ),
        pytest.param(
            "```python\ndef has_close_elements(numbers, threshold):\nreturn len(numbers) > 1\n```",
            "    return len(numbers) > 1\n",
            id="repeated-signature-over-unindented-body",
        ),
        pytest.param(
            "I'm sorry, but I can't complete this function without more details.", "", id="prose"
        ),
        pytest.param("```python\n```\nSure", "", id="empty-block"),
    ],
)
def test_extract_code(reply: str, expected: str):
    assert extract_code(reply, "has_close_elements") == expected


def test_defines_function_only_at_top_level():
    assert defines_function(FULL_DEF, "has_close_elements")
    assert not defines_function(
        "class A:\n    def has_close_elements(self):\n", "has_close_elements"
    )
    assert not defines_function("def has_close_elements_fast(x):\n", "has_close_elements")


def test_entry_point_of_every_humaneval_prompt_is_its_entry_point() -> None:
    from batchpage.humaneval.checks import load_problems
    from batchpage.humaneval.code_extract import entry_point_of

    problems = load_problems()
    assert all(entry_point_of(p["prompt"]) == p["entry_point"] for p in problems.values())
    assert entry_point_of("x = 1\n") is None
