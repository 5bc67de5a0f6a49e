"""The driver's work queue: windows of row positions waiting, running and done, exactly once.

A window is a contiguous range of the prefix order (see windows.py). Replicas take windows from
the front; each finished row is delivered once (a second delivery of a position is refused, so a
row can never reach the writer twice). When a replica dies, the rows of its windows that were
not delivered go back to the front of the queue as one window, still in prefix order, for the
next replica that asks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


def least_loaded(load: list[int], live: list[bool], most: int) -> int | None:
    """The live replica with the fewest windows (the lowest index among equals), or None when
    every live one holds `most`."""
    open_ = [i for i, n in enumerate(load) if live[i] and n < most]
    return min(open_, key=lambda i: load[i], default=None)


@dataclass(frozen=True)
class Window:
    id: int
    positions: tuple[int, ...]  # rows of the generate call, in prefix order
    retry: bool = False  # the rows a dead replica left


class WorkQueue:
    def __init__(self, windows: Iterable[Iterable[int]]) -> None:
        self._pending: deque[Window] = deque()
        self._running: dict[int, Window] = {}
        self._delivered: set[int] = set()
        self._next_id = 0
        self.requeued_rows = 0
        self.total = 0
        for positions in windows:
            window = self._new(positions)
            self._pending.append(window)
            self.total += len(window.positions)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def delivered(self) -> int:
        return len(self._delivered)

    @property
    def finished(self) -> bool:
        return not self._pending and not self._running

    def take(self) -> Window | None:
        """The next window to run, or None when nothing waits."""
        if not self._pending:
            return None
        window = self._pending.popleft()
        self._running[window.id] = window
        return window

    def deliver(self, window_id: int, position: int) -> bool:
        """A row of a running window finished. False (ignore it) if it was delivered already."""
        window = self._running.get(window_id)
        if window is None or position not in window.positions:
            raise ValueError(f"row {position} is not part of running window {window_id}")
        if position in self._delivered:
            return False
        self._delivered.add(position)
        return True

    def release(self, window_id: int) -> int:
        """The window's replica is done with it: it finished, or it died. Rows it did not
        deliver go back to the front of the queue as one window; returns how many."""
        return self._requeue(self._running.pop(window_id))

    def _requeue(self, window: Window) -> int:
        left = [p for p in window.positions if p not in self._delivered]
        if left:
            self._pending.appendleft(self._new(left, retry=True))
            self.requeued_rows += len(left)
        return len(left)

    def _new(self, positions: Iterable[int], retry: bool = False) -> Window:
        window = Window(self._next_id, tuple(positions), retry)
        self._next_id += 1
        return window

    def check_integrity(self) -> None:
        """Every row is in exactly one place: delivered, or undelivered in one waiting or running
        window (a running window may hold delivered rows too)."""
        waiting = [p for w in self._pending for p in w.positions]
        assert not set(waiting) & self._delivered, "a delivered row is waiting again"
        undelivered = [
            p for w in self._running.values() for p in w.positions if p not in self._delivered
        ]
        everywhere = waiting + undelivered
        assert len(everywhere) == len(set(everywhere)), "a row is queued twice"
        assert len(everywhere) + len(self._delivered) == self.total, "a row was lost"
