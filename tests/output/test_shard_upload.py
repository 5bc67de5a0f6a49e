"""Shards go up on their own thread: generation does not wait for a slow store, a failed write
keeps its rows (retried under the same key before newer shards), and nothing outlives the
writer's lock."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchpage.output import ShardWriter, finalize
from batchpage.storage import LocalStore
from tests.output.test_writer import JOB, result, shards


class GatedStore(LocalStore):
    """A local store whose shard creates wait for `gate` and fail while `failures` lasts."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.failures = 0
        self.created: list[str] = []

    def create_bytes(self, path: str, data: bytes) -> bool:
        self.gate.wait(timeout=30)
        if self.failures:
            self.failures -= 1
            raise OSError(f"injected failure writing {path}")
        self.created.append(Path(path).name)
        return super().create_bytes(path, data)


def test_rows_are_added_while_a_shard_is_still_going_up(tmp_path: Path) -> None:
    store = GatedStore()
    w = ShardWriter(str(tmp_path), JOB, flush_rows=2, flush_seconds=1e9, store=store)
    w.add(result(0))
    w.add(result(1))  # the first shard, handed over; the store holds it back
    assert w.num_done == 2 and w.num_saved == 0 and not shards(tmp_path)
    w.add(result(2))  # the generation goes on meanwhile
    store.gate.set()
    w.close()
    assert [pq.read_metadata(p).num_rows for p in shards(tmp_path)] == [2, 1]
    assert store.created == ["shard-00000.parquet", "shard-00001.parquet"]


def test_a_failed_write_is_retried_under_its_own_key_before_newer_shards(tmp_path: Path) -> None:
    store = GatedStore()
    store.gate.set()
    store.failures = 1
    w = ShardWriter(str(tmp_path), JOB, flush_rows=2, flush_seconds=1e9, store=store)
    w.add(result(0))
    w.add(result(1))  # fails on the upload thread
    with pytest.raises(OSError, match="injected failure"):
        w.add(result(2))
        w.add(result(3))  # the next flush raises the earlier failure
    assert w.num_saved == 0 and not shards(tmp_path)
    w.close()  # retries shard 0, then writes what is buffered
    assert store.created[0] == "shard-00000.parquet"
    assert (
        sorted(i for p in shards(tmp_path) for i in pq.read_table(p).column("index").to_pylist())
        == [0, 1, 2, 3][: w.num_done]
    )
    assert finalize(tmp_path, w.num_done).rows == w.num_done


def test_the_lock_is_released_only_after_the_shard_in_flight_lands(tmp_path: Path) -> None:
    store = GatedStore()
    w = ShardWriter(str(tmp_path), JOB, flush_rows=1, flush_seconds=1e9, store=store)
    w.add(result(0))
    closing = threading.Thread(target=w.close)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive()  # close waits for the upload, holding the lock
    with pytest.raises(Exception, match="in use"):
        ShardWriter(str(tmp_path), JOB, store=LocalStore())
    store.gate.set()
    closing.join(timeout=30)
    assert not closing.is_alive() and len(shards(tmp_path)) == 1
    ShardWriter(str(tmp_path), JOB, store=LocalStore()).close()  # free now
