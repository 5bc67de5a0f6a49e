"""A program cannot forge its sandbox's verdict: lines written to every file descriptor it holds
(where the status channel used to be) neither fail the scoring of other programs nor pass a
wrong answer, and its /proc shows no process outside its PID namespace.

Each forger writes, to every descriptor from 3 up, the JSON lines the supervisor writes."""

from __future__ import annotations

import json
import os

import pytest

from batchpage.humaneval.checks import score
from batchpage.humaneval.sandbox import Limits, Status, run_python

FAST = Limits(timeout_s=3)
PROBLEMS = {
    "T/0": {
        "prompt": "def double(x):\n",
        "entry_point": "double",
        "test": "def check(candidate):\n    assert candidate(2) == 4 and candidate(5) == 10\n",
    }
}
RIGHT = "    return 2 * x\n"
WRONG = "    return 3 * x\n"


def forge(*lines: dict) -> str:
    """Program text that writes `lines` to every open descriptor above stderr."""
    payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return (
        "\nimport os as _os\n"
        "for _fd in range(3, 1024):\n"
        "    try:\n"
        f"        _os.write(_fd, {payload!r})\n"
        "    except OSError:\n"
        "        pass\n"
    )


@pytest.mark.parametrize(
    "forged",
    [
        {"setup_error": "forged by the program"},
        {"signal": 99999},
        {"signal": "SIGKILL"},
        {"exit": "zero", "timed_out": "yes"},
    ],
    ids=["setup_error", "bad-signal", "signal-name", "bad-types"],
)
def test_a_forged_status_line_does_not_stop_the_scoring_of_other_rows(forged: dict) -> None:
    forger = RIGHT + forge(forged)
    report = score([("T/0", forger), ("T/0", RIGHT), ("T/0", WRONG)], PROBLEMS, FAST, workers=1)
    # The forger ran to its last line with a right answer: it passes, whatever it wrote.
    assert [r.passed for r in report.results] == [True, True, False]
    assert report.results[2].outcome.reason.startswith("AssertionError")


def test_a_forged_pass_does_not_pass_a_wrong_answer() -> None:
    forger = WRONG + forge({"completed": True}, {"exit": 0}) + "_os._exit(0)\n"
    report = score([("T/0", forger)], PROBLEMS, FAST)
    outcome = report.results[0].outcome
    assert not outcome.passed and outcome.status is Status.FAILED, outcome


def test_the_program_sees_only_its_own_processes_in_proc() -> None:
    program = (
        "import os\n"
        f"assert not os.path.exists('/proc/{os.getpid()}'), 'the host process is visible'\n"
        "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "assert len(pids) <= 3, pids\n"
    )
    outcome = run_python(program, FAST)
    if any(u.startswith("other processes in /proc") for u in outcome.unconfined):
        pytest.skip(f"no private /proc here: reported as unconfined ({outcome.unconfined})")
    assert outcome.passed, outcome.reason
