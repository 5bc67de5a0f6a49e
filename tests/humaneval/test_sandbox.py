"""The sandbox against programs that misbehave: each test fails when its confinement is missing.

Processes are found by scanning /proc for a `sleep <unique number>` command line; a killed process
that is still a zombie has an empty command line and does not count.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from batchpage.humaneval.sandbox import Limits, Outcome, Status, run_python

SLEEP = shutil.which("sleep")
FAST = Limits(timeout_s=1.5)


def sleepers(marker: str) -> list[int]:
    want = f"sleep\0{marker}\0".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == want:
                found.append(int(pid))
        except OSError:
            continue
    return found


def gone(marker: str, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while sleepers(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fork_sleeper(marker: str, setsid: bool = False) -> str:
    """Program text: fork through libc (the guard's os.fork = None does not stop that) a child
    that becomes `sleep <marker>`, and print whether the fork worked."""
    return (
        "import ctypes, os\n"
        "pid = ctypes.CDLL(None).fork()\n"
        "if pid == 0:\n"
        f"    {'os.setsid()' if setsid else 'pass'}\n"
        f"    os.execv({SLEEP!r}, ['sleep', {marker!r}])\n"
        "print('forked', pid > 0, flush=True)\n"
    )


def unique_seconds() -> str:
    return f"30.{uuid.uuid4().int % 10**9:09d}"


def unconfined(outcome: Outcome, what: str) -> bool:
    return any(item.startswith(what) for item in outcome.unconfined)


def test_a_plain_program_passes_and_its_output_is_kept():
    outcome = run_python("def f(x):\n    return 2 * x\n\nassert f(2) == 4\nprint('ok', f(21))\n")
    assert outcome.status is Status.PASSED and outcome.passed
    assert outcome.reason == "passed"
    assert outcome.output == "ok 42\n"


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("assert 1 + 1 == 3, 'arithmetic'", "AssertionError: arithmetic"),
        ("import sys\nsys.exit(0)", "SystemExit: 0"),
        ("import os\nos._exit(0)", "SystemExit: os._exit(0) before the program's end"),
        ("import posix\nposix._exit(0)", "SystemExit: os._exit(0) before"),
        ("def f(:\n    pass", "SyntaxError"),
    ],
)
def test_a_program_that_fails_or_exits_early_fails(source: str, reason: str):
    outcome = run_python(source, FAST)
    assert outcome.status is Status.FAILED and not outcome.passed
    assert outcome.reason.startswith(reason)


def test_a_program_killed_by_a_signal_is_reported_as_killed():
    outcome = run_python("import ctypes\nctypes.string_at(0)\n", FAST)  # reads address 0
    assert outcome.status is Status.KILLED and not outcome.passed
    assert outcome.reason.startswith("killed by SIGSEGV")


def test_the_program_runs_as_nobody_when_root():
    expected = 65534 if os.geteuid() == 0 else os.getuid()
    outcome = run_python(f"import os\nassert os.getuid() == {expected}, os.getuid()\n", FAST)
    assert outcome.passed, outcome.reason


def test_human_evals_reliability_guard_is_applied():
    outcome = run_python("import subprocess\nsubprocess.Popen(['true'])\n", FAST)
    assert outcome.status is Status.FAILED
    assert outcome.reason == "TypeError: 'NoneType' object is not callable"


def test_a_busy_loop_times_out():
    started = time.monotonic()
    outcome = run_python("while True:\n    pass\n", FAST)
    assert outcome.status is Status.TIMED_OUT and not outcome.passed
    assert outcome.reason == "timed out after 1.5 s"
    assert time.monotonic() - started < FAST.timeout_s + 3


def test_a_forked_child_sleeping_past_the_timeout_is_stopped_and_leaves_nothing():
    marker = unique_seconds()
    outcome = run_python(fork_sleeper(marker) + "import time\ntime.sleep(60)\n", FAST)
    assert "forked True" in outcome.output
    assert outcome.status is Status.TIMED_OUT and not outcome.passed
    assert gone(marker), f"sleep {marker} outlived the sandbox: {sleepers(marker)}"


@pytest.mark.parametrize("setsid", [False, True], ids=["in-group", "setsid"])
def test_a_background_child_does_not_outlive_the_program(setsid: bool):
    marker = unique_seconds()
    outcome = run_python(fork_sleeper(marker, setsid), FAST)
    assert "forked True" in outcome.output
    if setsid and unconfined(outcome, "processes that leave"):
        pytest.skip("without a PID namespace a setsid child escapes: reported as unconfined")
    assert gone(marker), f"sleep {marker} outlived the sandbox: {sleepers(marker)}"


def test_the_number_of_processes_is_limited():
    marker = unique_seconds()
    source = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None)\n"
        "started = 0\n"
        "for _ in range(40):\n"
        "    pid = libc.fork()\n"
        "    if pid == 0:\n"
        f"        os.execv({SLEEP!r}, ['sleep', {marker!r}])\n"
        "    started += pid > 0\n"
        "print('started', started, flush=True)\n"
    )
    limits = Limits(timeout_s=5, processes=4)
    outcome = run_python(source, limits)
    started = int(outcome.output.split("started ")[1].split()[0])
    assert 1 <= started < limits.processes
    assert gone(marker)


def test_unbounded_allocation_is_stopped():
    source = "chunks = []\nwhile True:\n    chunks.append(b'x' * (64 << 20))\n"
    outcome = run_python(source, Limits(timeout_s=10, memory_bytes=512 << 20))
    assert outcome.status is Status.FAILED
    assert outcome.reason.startswith("MemoryError")


def test_files_and_output_are_limited_in_size():
    limits = Limits(timeout_s=5, file_bytes=1 << 20)
    big_file = run_python("open('big.bin', 'wb').write(b'x' * (8 << 20))\n", limits)
    assert big_file.status is Status.FAILED
    assert "File too large" in big_file.reason
    endless_print = run_python("while True:\n    print('x' * 1000)\n", limits)
    assert endless_print.status is Status.FAILED  # not timed out: stopped at the size limit
    assert len(endless_print.output) <= 2000


def test_writes_outside_the_working_folder_do_not_land(tmp_path: Path):
    owned = tmp_path / "escape.txt"  # in pytest's folder, mode 700
    shared = Path(tempfile.gettempdir()) / f"batchpage-escape-{uuid.uuid4().hex}"  # mode 1777
    source = (
        f"for path in [{str(owned)!r}, {str(shared)!r}]:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
        "with open('inside.txt', 'w') as f:\n"
        "    f.write('kept')\n"
        "assert open('inside.txt').read() == 'kept'\n"
    )
    before = set(Path(tempfile.gettempdir()).glob("batchpage-sandbox-*"))
    outcome = run_python(source, FAST)
    assert outcome.passed, outcome.output  # its own folder is writable
    assert set(Path(tempfile.gettempdir()).glob("batchpage-sandbox-*")) == before  # and removed
    if unconfined(outcome, "filesystem writes"):
        pytest.skip("not root: the program writes with the caller's permissions (reported)")
    try:
        assert not owned.exists()
        assert not shared.exists()
    finally:
        shared.unlink(missing_ok=True)


def test_the_program_cannot_reach_a_listening_socket():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        outcome = run_python(source, Limits(timeout_s=5))
        if unconfined(outcome, "network"):
            pytest.skip("no network namespace here: reported as unconfined")
        assert outcome.status is Status.FAILED
        assert "Network is unreachable" in outcome.reason
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        Limits(timeout_s=0)
