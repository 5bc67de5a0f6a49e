"""A reverse HTTP proxy on 127.0.0.1 in front of a storage server, for fault tests: it forwards
every request as it came (Host header included, so signed requests and the emulator's upload
URLs stay valid), counts requests and bytes, and on demand fails the next requests.

    with FlakyProxy("http://127.0.0.1:9000") as proxy:   # proxy.endpoint: where clients go
        proxy.fail_next(2)            # the next 2 requests answer 503
        proxy.stall_next(1, 30.0)     # the next one gets no answer for 30 s, then a closed socket
        proxy.drop_next(1)            # the next one: the connection closes unanswered
        proxy.counts.requests, proxy.counts.bytes_out

A fault may be limited to requests a predicate picks (`match=lambda method, path: ...`).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Match = Callable[[str, str], bool]
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
)


@dataclass
class Counts:
    """What went through: requests (and per method), request body bytes in, response body bytes
    out, and the faults injected."""

    requests: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    faults: int = 0


@dataclass
class Fault:
    kind: str  # "status", "stall" or "drop"
    left: int
    status: int = 503
    seconds: float = 0.0
    match: Match | None = None


class FlakyProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.counts = Counts()
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FlakyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()  # ends stalls early
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FlakyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- faults --------------------------------------------------------------------------------

    def fail_next(self, k: int, status: int = 503, match: Match | None = None) -> None:
        self._add(Fault("status", k, status=status, match=match))

    def stall_next(self, k: int, seconds: float, match: Match | None = None) -> None:
        self._add(Fault("stall", k, seconds=seconds, match=match))

    def drop_next(self, k: int, match: Match | None = None) -> None:
        self._add(Fault("drop", k, match=match))

    def clear(self) -> None:
        """No more faults; counts back to zero."""
        with self._lock:
            self._faults.clear()
            self.counts = Counts()

    def _add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def _take(self, method: str, path: str, body: bytes) -> Fault | None:
        """Count a request and pick the fault it gets, if any."""
        with self._lock:
            c = self.counts
            c.requests += 1
            c.by_method[method] = c.by_method.get(method, 0) + 1
            c.bytes_in += len(body)
            for fault in self._faults:
                if fault.left > 0 and (fault.match is None or fault.match(method, path)):
                    fault.left -= 1
                    c.faults += 1
                    return fault
        return None

    def _sent(self, n: int) -> None:
        with self._lock:
            self.counts.bytes_out += n

    # --- the handler ---------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect

            def log_message(self, format: str, *args: object) -> None:
                return None

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _drop(self) -> None:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _forward(self) -> None:
                body = self._body()
                fault = proxy._take(self.command, self.path, body)
                if fault is not None and fault.kind == "drop":
                    return self._drop()
                if fault is not None and fault.kind == "stall":
                    proxy._closing.wait(fault.seconds)
                    return self._drop()
                if fault is not None:
                    payload = b"injected fault"
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                up = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    up.request(self.command, self.path, body=body, headers=headers)
                    resp = up.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in HOP_BY_HOP:
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        length = resp.getheader("Content-Length")
                        if length is not None:
                            self.send_header("Content-Length", length)
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                        proxy._sent(len(data))
                finally:
                    up.close()
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

        return Handler
