"""The object-storage job lock (batchpage/storage/lease.py) on S3 (moto) and GCS (the emulator):
held while its holder beats, taken over once expired, lost by a holder that was taken over,
free at once after a release. Lease objects are read back with boto3 / google-cloud-storage."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from batchpage.storage import LockHeldError, OutputLostError
from batchpage.storage.lease import Lease, lease_path
from tests.storage.conftest import StoreCase

LEASE_S = 2.0  # short, so that expiry and takeover happen within a test


def leases(remote: StoreCase, folder: str) -> list[str]:
    return [k for k in remote.keys(folder) if "/lease/" in k]


def test_a_second_taker_is_refused_in_one_line(remote: StoreCase) -> None:
    store, folder = remote.store, remote.root
    first = store.lock(folder, LEASE_S)
    try:
        with pytest.raises(LockHeldError) as e:
            store.lock(folder, LEASE_S)
        message = str(e.value)
        record = json.loads(remote.read(lease_path(store, folder, 1)))
        assert "\n" not in message
        assert f"host {record['host']} pid {record['pid']}" in message
        assert "holds its lease, which expires in" in message
        first.check()
    finally:
        first.release()


def test_heartbeats_keep_the_lease(remote: StoreCase) -> None:
    store, folder = remote.store, remote.root
    first = store.lock(folder, LEASE_S)
    try:
        written = json.loads(remote.read(lease_path(store, folder, 1)))["expires_at"]
        time.sleep(2 * LEASE_S)  # past the first expiry: only heartbeats keep it
        with pytest.raises(LockHeldError):
            store.lock(folder, LEASE_S)
        assert json.loads(remote.read(lease_path(store, folder, 1)))["expires_at"] > written
        first.check()
    finally:
        first.release()


def test_release_frees_the_folder_at_once(remote: StoreCase) -> None:
    store, folder = remote.store, remote.root
    store.lock(folder, 60.0).release()
    second = store.lock(folder, 60.0)  # no wait for the 60 s
    assert leases(remote, folder) == [second.path]
    second.release()
    second.release()  # idempotent
    assert leases(remote, folder) == []


def test_a_dead_holder_is_taken_over_after_expiry(remote: StoreCase) -> None:
    """A holder killed with kill -9 (a real process) blocks the folder only until its lease
    expires."""
    folder = remote.root
    code = (
        "import sys, time\n"
        "from batchpage.storage import Stores\n"
        f"Stores().store_for({folder!r}).lock({folder!r}, {LEASE_S})\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
        env={**__import__("os").environ, **remote.server.env},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeldError):
            remote.store.lock(folder, LEASE_S)
        holder.kill()
        holder.wait()
        record = json.loads(remote.read(lease_path(remote.store, folder, 1)))
        time.sleep(max(0.0, record["expires_at"] - time.time()) + 0.2)
        taker = remote.store.lock(folder, LEASE_S)
    finally:
        holder.kill()
        holder.wait()
    assert taker.seq == 2 and taker.path in leases(remote, folder)
    taker.release()


def test_the_old_holder_learns_it_was_taken_over(remote: StoreCase) -> None:
    """A taker whose clock says the lease expired (a skewed clock, or a holder that stalled)
    creates lease 2; the old holder's next heartbeat sees it and check() raises."""
    store, folder = remote.store, remote.root
    old = Lease.take(store, folder, LEASE_S)
    ahead = Lease.take(store, folder, LEASE_S, clock=lambda: time.time() + 10 * LEASE_S)
    try:
        assert ahead.seq == 2
        deadline = time.monotonic() + LEASE_S
        while time.monotonic() < deadline and not old._lost:
            time.sleep(0.05)
        assert time.monotonic() < deadline, "no heartbeat noticed the takeover"
        with pytest.raises(OutputLostError):
            old.check()
        ahead.check()
        old.release()  # a lost lease leaves the new holder's object alone
        assert lease_path(store, folder, 2) in leases(remote, folder)
    finally:
        ahead.release()
        old.release()


def test_a_holder_that_cannot_beat_stops_claiming(remote: StoreCase) -> None:
    """Without a successful heartbeat for most of lease_seconds, check() raises before anyone
    may take over (the clock margin)."""
    store, folder = remote.store, remote.root
    lease = Lease.take(store, folder, LEASE_S)
    lease._stop.set()  # the heartbeat thread ends: as if every beat failed
    lease._thread.join()
    lease.check()
    time.sleep(LEASE_S * 0.8)
    with pytest.raises(OutputLostError):
        lease.check()
    record = json.loads(remote.read(lease.path))
    assert record["expires_at"] > time.time()  # it gave up before its lease expired
    lease.release()


def test_racing_takers_after_expiry_one_wins(remote: StoreCase) -> None:
    store, folder = remote.store, remote.root
    dead = Lease.take(store, folder, LEASE_S)
    dead._stop.set()
    dead._thread.join()
    time.sleep(LEASE_S + 0.2)
    won: list[Lease] = []
    refused: list[LockHeldError] = []
    gate = threading.Barrier(4)

    def take() -> None:
        gate.wait()
        try:
            won.append(Lease.take(store, folder, LEASE_S))
        except LockHeldError as e:
            refused.append(e)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert (len(won), len(refused)) == (1, 3)
        assert won[0].seq == 2
    finally:
        for lease in won:
            lease.release()
