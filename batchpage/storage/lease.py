"""The job lock on object storage: a lease that needs nothing of the store but a conditional
create (`Store.create_bytes`), an overwrite, a listing and a delete.

Lease objects are `<folder>/lease/lease-<seq:08d>.json`, each holding {owner, host, pid, started,
expires_at}. The highest seq is the current lease.

- Take: no lease -> create seq 1. The highest, N, not expired -> LockHeldError naming its holder.
  N expired -> create N+1; of any number of contenders exactly one create succeeds, the others
  list again and find N+1 held.
- Heartbeat: a daemon thread, every lease_seconds/4, first checks that no N+1 exists (if one does,
  another job took over: lost), then rewrites N with a later expires_at.
- `check()` raises OutputLostError once the lease is lost, or once the last successful heartbeat
  is older than lease_seconds less a margin of a quarter of it: past that, another job may
  already have found it expired, so we cannot know we still hold it.
- `release()` stops the heartbeat and deletes N: the next job takes the folder at once.

Clock assumption: expiry compares the wall clock of the holder, which wrote expires_at, with the
wall clock of the taker, which reads it. The holder gives up (check raises) a quarter of
lease_seconds before its lease expires, so two jobs never both believe they hold the folder
while their clocks disagree by less than that quarter (NTP keeps machines within milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from batchpage.storage.store import JobLock, LockHeldError, OutputLostError, Store

log = logging.getLogger(__name__)

LEASE_DIR = "lease"
_NAME = re.compile(r"^lease-(\d{8})\.json$")
# A contender that loses a create lists again; so many losses in a row means leases are taken
# and released faster than we can look, which a batch job's folder never sees.
TAKE_ROUNDS = 10


@dataclass(frozen=True)
class LeaseRecord:
    """What a lease object holds; times are seconds since the epoch (the writer's clock)."""

    owner: str
    host: str
    pid: int
    started: float
    expires_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseRecord | None:
        """The record, or None for bytes that are not one (such a lease counts as expired)."""
        try:
            d = json.loads(data)
            return cls(
                str(d["owner"]),
                str(d["host"]),
                int(d["pid"]),
                float(d["started"]),
                float(d["expires_at"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def lease_seq(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


class Lease(JobLock):
    """A held lease on an output folder; make one with `Lease.take`."""

    def __init__(
        self,
        store: Store,
        folder: str,
        seq: int,
        record: LeaseRecord,
        lease_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.folder = folder
        self.seq = seq
        self.record = record
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._last_ok = time.monotonic()  # when the last successful write of the lease began
        self._lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- taking --------------------------------------------------------------------------------

    @classmethod
    def take(
        cls,
        store: Store,
        folder: str,
        lease_seconds: float,
        clock: Callable[[], float] = time.time,
    ) -> Lease:
        """Take the folder, starting the heartbeat; LockHeldError while a live job holds it."""
        for _ in range(TAKE_ROUNDS):
            top = cls._current(store, folder)
            seq = 1
            if top is not None:
                seq, record = top
                now = clock()
                if record is not None and record.expires_at > now:
                    raise LockHeldError(
                        f"the job on host {record.host} pid {record.pid} holds its lease, which "
                        f"expires in {record.expires_at - now:.0f} s if that job died"
                    )
                seq += 1
            started = clock()
            mine = LeaseRecord(
                uuid.uuid4().hex, socket.gethostname(), os.getpid(), started,
                started + lease_seconds,
            )  # fmt: skip
            began = time.monotonic()
            if store.create_bytes(lease_path(store, folder, seq), mine.to_bytes()):
                lease = cls(store, folder, seq, mine, lease_seconds, clock)
                lease._last_ok = began
                lease._forget_before(seq - 1)
                lease._start()
                return lease
        raise LockHeldError(f"{folder}: its lease changed hands {TAKE_ROUNDS} times while we tried")

    @staticmethod
    def _current(store: Store, folder: str) -> tuple[int, LeaseRecord | None] | None:
        """The highest lease and its record (None when unreadable); None when there is none.
        A lease deleted between the listing and the read (released) means: list again."""
        while True:
            seqs = lease_seqs(store, folder)
            if not seqs:
                return None
            try:
                data = store.read_bytes(lease_path(store, folder, seqs[-1]))
            except FileNotFoundError:
                continue
            return seqs[-1], LeaseRecord.from_bytes(data)

    def _forget_before(self, seq: int) -> None:
        """Delete leases below `seq` (long dead); the one just before ours stays, so that its
        holder, if it still runs, sees ours above it."""
        for old in lease_seqs(self.store, self.folder):
            if old < seq:
                with contextlib.suppress(OSError):
                    self.store.delete(lease_path(self.store, self.folder, old))

    # --- holding -------------------------------------------------------------------------------

    @property
    def margin(self) -> float:
        return self.lease_seconds / 4

    def _stale(self) -> bool:
        return time.monotonic() - self._last_ok > self.lease_seconds - self.margin

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._beat, name=f"lease-heartbeat {self.folder}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_seconds / 4):
            if self._stale():
                self._lost = True
                return
            began = time.monotonic()
            try:
                if self.store.exists(lease_path(self.store, self.folder, self.seq + 1)):
                    self._lost = True
                    return
                renewed = replace(self.record, expires_at=self.clock() + self.lease_seconds)
                self.store.write_bytes(self.path, renewed.to_bytes())
            except Exception as e:  # noqa: BLE001 - a failed beat is retried; check() judges
                log.warning("lease heartbeat of %s failed: %s", self.folder, type(e).__name__)
                continue
            self.record = renewed
            self._last_ok = began

    @property
    def path(self) -> str:
        return lease_path(self.store, self.folder, self.seq)

    def check(self) -> None:
        if self._lost or self._stale():
            self._lost = True
            raise OutputLostError(
                f"{self.folder}: this job lost its lease (no heartbeat for "
                f"{time.monotonic() - self._last_ok:.0f} s, or another job took the folder "
                "over); stopping without writing more"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lease object; a lost lease's object is left to
        the job that took over (it shows that job the lease it followed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if not self._lost:
                with contextlib.suppress(OSError):
                    self.store.delete(self.path)


def lease_path(store: Store, folder: str, seq: int) -> str:
    return store.join(folder, LEASE_DIR, f"lease-{seq:08d}.json")


def lease_seqs(store: Store, folder: str) -> list[int]:
    """The seqs of the lease objects in a folder, ascending."""
    infos = store.files_under(store.join(folder, LEASE_DIR))
    seqs = (lease_seq(store.name(i.path)) for i in infos)
    return sorted(s for s in seqs if s is not None)
