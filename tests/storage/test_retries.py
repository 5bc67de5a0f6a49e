"""Transient failures of the storage server (503s, stalls past the client's timeout, dropped
connections) injected by a proxy in front of moto / the emulator: retried with backoff up to
`storage.retries` tries, then a StorageError naming the URL; refusals are not retried."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from batchpage.storage import StorageConfig, StorageError, Stores
from batchpage.storage.retry import RetryPolicy, is_transient
from tests.extras import require
from tests.storage.conftest import StoreCase, make_case
from tests.storage.flaky_proxy import FlakyProxy

TRIES = 4
SECRET = "s3cr3t-never-shown"


@contextlib.contextmanager
def through_proxy(case: StoreCase, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """(store through a proxy, the proxy, case): the clients' environment points at the proxy,
    requests time out after 1 s."""
    with FlakyProxy(case.server.endpoint) as proxy:
        for name, value in case.server.endpoint_at(proxy.endpoint).items():
            monkeypatch.setenv(name, value)
        config = StorageConfig(
            retries=TRIES,
            s3={
                "key": "testing",
                "secret": SECRET,
                "config_kwargs": {"read_timeout": 1, "connect_timeout": 1},
            },
            gs={"requests_timeout": 1},
        )
        yield Stores(config).store_for(case.root), proxy, case


@pytest.fixture
def proxied(remote: StoreCase, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    with through_proxy(remote, monkeypatch) as triple:
        yield triple


@pytest.fixture
def proxied_s3(request: pytest.FixtureRequest, tmp_path, monkeypatch) -> Iterator[tuple]:
    """S3 only: gcsfs retries each request itself (a fixed 6 tries over half a minute), so the
    count of tries is ours alone only on S3."""
    with through_proxy(make_case("s3", request, tmp_path), monkeypatch) as triple:
        yield triple


def test_5xx_answers_are_retried(proxied: tuple) -> None:
    store, proxy, case = proxied
    path = store.join(case.root, "a.json")
    proxy.fail_next(2)
    store.write_bytes(path, b"payload")
    assert case.read(path) == b"payload"
    proxy.fail_next(2)
    assert store.read_bytes(path) == b"payload"
    proxy.fail_next(2)
    assert store.create_bytes(store.join(case.root, "b.json"), b"once") is True
    assert proxy.counts.faults == 6


def test_dropped_connections_are_retried(proxied: tuple) -> None:
    store, proxy, case = proxied
    path = store.join(case.root, "a.json")
    proxy.drop_next(2)
    store.write_bytes(path, b"payload")
    proxy.drop_next(2)
    assert [i.path for i in store.files_under(case.root)] == [path]
    assert case.read(path) == b"payload" and proxy.counts.faults == 4


def test_a_stalled_request_times_out_and_is_retried(proxied: tuple) -> None:
    store, proxy, case = proxied
    path = store.join(case.root, "a.json")
    store.write_bytes(path, b"payload")
    proxy.stall_next(1, 30.0)
    started = time.monotonic()
    assert store.read_bytes(path) == b"payload"
    assert time.monotonic() - started < 10  # the client's 1 s timeout, not the 30 s stall
    assert proxy.counts.faults == 1


def test_past_the_tries_a_clear_error(proxied_s3: tuple) -> None:
    store, proxy, case = proxied_s3
    path = store.join(case.root, "shard.parquet")
    proxy.fail_next(1000)
    with pytest.raises(StorageError) as e:
        store.create_bytes(path, b"rows")
    assert proxy.counts.requests == TRIES  # our tries only: the client's own are off
    message = str(e.value)
    assert path in message and f"{TRIES} tries" in message and "HTTP 503" in message
    assert "storage.retries" in message and SECRET not in message
    proxy.clear()
    assert store.create_bytes(path, b"rows") is True  # the store recovers with the server


def test_a_refusal_is_not_retried_and_names_the_fix(proxied: tuple) -> None:
    store, proxy, case = proxied
    path = store.join(case.root, "a.json")
    proxy.fail_next(1, status=403)
    with pytest.raises(StorageError) as e:
        store.write_bytes(path, b"x")
    assert proxy.counts.requests == 1
    message = str(e.value)
    assert path in message and "access denied" in message and SECRET not in message
    hint = "AWS_ACCESS_KEY_ID" if case.name == "s3" else "GOOGLE_APPLICATION_CREDENTIALS"
    assert hint in message


# --- the policy itself ---------------------------------------------------------------------------


def test_policy_backs_off_with_jitter_and_gives_up() -> None:
    waits: list[float] = []
    policy = RetryPolicy(tries=5, base=0.1, cap=0.5, sleep=waits.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):
        policy.call(flaky)
    assert len(calls) == 5 and len(waits) == 4
    assert all(0 <= w <= min(0.5, 0.1 * 2**i) for i, w in enumerate(waits))

    calls.clear()
    with pytest.raises(FileNotFoundError):
        policy.call(lambda: calls.append(1) or (_ for _ in ()).throw(FileNotFoundError("x")))
    assert len(calls) == 1  # a missing object is no passing failure


def test_transient_errors_of_the_clients() -> None:
    require("s3fs", "cloud")  # brings botocore and aiohttp
    from aiohttp.client_exceptions import ServerDisconnectedError
    from botocore.exceptions import ClientError, ReadTimeoutError

    def client_error(status: int, code: str) -> OSError:
        e = OSError(5, "wrapped as s3fs does")
        e.__cause__ = ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )
        return e

    assert is_transient(client_error(503, "SlowDown"))
    assert is_transient(client_error(500, "InternalError"))
    assert not is_transient(client_error(403, "AccessDenied"))
    assert not is_transient(client_error(400, "InvalidArgument"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ServerDisconnectedError())
    assert not is_transient(FileExistsError("exists"))
    assert not is_transient(ValueError("bad"))
