"""Retrying a storage request that failed for a passing reason (a 5xx answer, a timeout, a dropped
connection), with exponential backoff and full jitter, up to a number of tries.

    policy = RetryPolicy(tries=6)
    info = policy.call(fs.info, path)

Which failures pass is read from the exception and its causes (the clients wrap botocore,
aiohttp and requests errors in OSError): an HTTP status of 408, 429 or >= 500, a timeout, or a
connection that was refused, reset or closed mid-answer. A missing object, a refused permission,
a failed precondition or a bad request is answered at once: trying again cannot change it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# Statuses a server sends for a failure that may pass: timeout, throttling, its own fault.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Error codes S3-like servers send in the body for the same (with any status).
TRANSIENT_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling"}
)
# Classes (anywhere in an exception's MRO) of the clients' connection and timeout failures,
# named rather than imported: no client package is needed to classify another's errors.
TRANSIENT_CLASSES = frozenset(
    {
        "HTTPClientError",  # botocore: EndpointConnectionError, ReadTimeoutError, ...
        "ResponseStreamingError",  # botocore: a body cut short
        "IncompleteRead",
        "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
        "ClientPayloadError",  # aiohttp: a body cut short
        "ServerTimeoutError",
        "ChunkedEncodingError",  # requests
        "ProxyError",  # gcsfs raises it for a 502
    }
)
# Errors that never pass, whatever they wrap.
PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)


def _causes(error: BaseException) -> list[BaseException]:
    """The error and the chain of errors it was raised from or during (no cycles)."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _status(error: BaseException) -> int | None:
    """The HTTP status an error carries, from botocore (response), gcsfs (code) or aiohttp
    (status)."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    for name in ("status", "code"):
        value = getattr(error, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def error_code(error: BaseException) -> str | None:
    """The service's error code (botocore's "NoSuchBucket", "AccessDenied"), or None."""
    for e in _causes(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def status_of(error: BaseException) -> int | None:
    """The first HTTP status found in an error's chain."""
    for e in _causes(error):
        status = _status(e)
        if status is not None:
            return status
    return None


def is_transient(error: BaseException) -> bool:
    """Whether trying again may succeed (see the module's docstring)."""
    if isinstance(error, PERMANENT):
        return False
    for e in _causes(error):
        if isinstance(e, (TimeoutError, ConnectionError)):
            return True
        status = _status(e)
        if status is not None:
            return status in TRANSIENT_STATUSES
        if error_code(e) in TRANSIENT_CODES:
            return True
        if any(cls.__name__ in TRANSIENT_CLASSES for cls in type(e).__mro__):
            return True
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `tries` tries in all; before try n+1 a random wait in [0, min(cap, base * 2**n)]
    ("full jitter": contenders that failed together do not come back together)."""

    tries: int = 6
    base: float = 0.2
    cap: float = 10.0
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * 2**attempt))

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """fn(*args, **kwargs), tried again on a transient failure; the last failure, or the
        first permanent one, is raised."""
        for attempt in range(self.tries):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if attempt + 1 >= self.tries or not is_transient(e):
                    raise
            self.sleep(self.delay(attempt))
        raise AssertionError("unreachable: the last try returns or raises")

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """fn, each call of it retried."""

        def retried(*args: object, **kwargs: object) -> T:
            return self.call(fn, *args, **kwargs)

        return retried
