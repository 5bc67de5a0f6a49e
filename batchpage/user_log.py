"""What batchpage's logger says reaches the user, through the command line and the Python API.

The library logs through `logging.getLogger("batchpage.<module>")` (a kernel build, a tokenizer
conversion). Under the command line Hydra configures the root logger, and the records go there.
A Python program that configured no logging would see nothing below WARNING, so a first use
that compiles kernels for minutes would look hung: `configure_package_logging` gives the package
logger a stderr handler that speaks only while the root logger has no handler of its own (once
the program configures logging, records go to its handlers alone, never twice).

`heartbeat` says every few seconds that a long step is still running, so no step leaves the
user without output for longer than that.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

PACKAGE = "batchpage"
HEARTBEAT_S = 10.0


class _UnlessConfigured(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


class PackageHandler(logging.StreamHandler):
    """stderr, "batchpage: <message>", while the program has configured no logging."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(f"{PACKAGE}: %(message)s"))
        self.addFilter(_UnlessConfigured())

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)  # the stderr of now (a test or a tool may have replaced it)
        super().emit(record)


def configure_package_logging() -> None:
    """Give the package logger a PackageHandler and level INFO, unless it has a handler or a
    level already (the program's choice wins). Idempotent."""
    logger = logging.getLogger(PACKAGE)
    if not logger.handlers:
        logger.addHandler(PackageHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


@contextlib.contextmanager
def heartbeat(log: logging.Logger, what: str, every: float = HEARTBEAT_S) -> Iterator[None]:
    """While the block runs, log "<what>: still running (N s)" every `every` seconds."""
    done = threading.Event()
    started = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            log.info("%s: still running (%.0f s)", what, time.perf_counter() - started)

    thread = threading.Thread(target=beat, name=f"{PACKAGE}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
