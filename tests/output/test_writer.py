"""Shards, resume, crash safety, job identity, the final file and run.json."""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpage.output import (
    FINAL_FILE,
    IncompleteOutputError,
    OutputDirError,
    ResultRow,
    ShardWriter,
    finalize,
    output_schema,
    work_dir,
    write_run_json,
)

JOB = {"model": "tiny", "sampling": {"temperature": 0.0, "max_tokens": 8}, "dataset": "fp1"}


def result(i: int, n: int = 1) -> ResultRow:
    text = f"out{i}" if n == 1 else [f"out{i}.{k}" for k in range(n)]
    reason = "stop" if n == 1 else ["stop"] * n
    return ResultRow(i, f"id{i}", f"p{i}", text, reason, 3, 2 * n, 1, None)


def shards(d: Path) -> list[Path]:
    return sorted(work_dir(d).glob("shard-*.parquet"))


def crash(writer: ShardWriter) -> None:
    """What kill -9 leaves: the buffer is gone, the OS drops the lock."""
    writer._buffer = []
    writer._release()


def test_schema_is_typed_for_n() -> None:
    assert output_schema(1).field("completion").type == pa.string()
    assert output_schema(3).field("completion").type == pa.list_(pa.string())
    assert output_schema(3).field("finish_reason").type == pa.list_(pa.string())
    assert output_schema(1).field("cached_tokens").type == pa.int64()


def test_flushes_every_k_rows_atomically(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=3, flush_seconds=1e9) as w:
        for i in range(7):
            w.add(result(i))
        w.settle()  # the shards handed to the upload thread
        assert len(shards(tmp_path)) == 2  # 3 + 3 written, 1 buffered
        assert not list(tmp_path.glob(".*.tmp"))
    assert len(shards(tmp_path)) == 3
    assert [pq.read_metadata(p).num_rows for p in shards(tmp_path)] == [3, 3, 1]


def test_flushes_after_t_seconds(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=100, flush_seconds=0.05) as w:
        w.add(result(0))
        assert not w.maybe_flush() and not shards(tmp_path)
        time.sleep(0.06)
        assert w.maybe_flush()
        w.settle()
        assert len(shards(tmp_path)) == 1


def test_all_null_error_column_and_error_rows_write(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB) as w:
        w.add(result(0))
        w.add(ResultRow.failed(1, "id1", "prompt is null"))
    table = pq.read_table(finalize(tmp_path, 2).path)
    assert table.schema == output_schema(1)
    assert table.column("error").to_pylist() == [None, "prompt is null"]
    assert table.column("completion").to_pylist() == ["out0", None]
    # A shard whose error column is entirely null keeps its string type.
    assert pq.read_schema(shards(tmp_path)[0]).field("error").type == pa.string()


def test_resume_skips_done_rows_and_never_duplicates(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=4) as w:
        for i in (5, 0, 3):
            w.add(result(i))
    with ShardWriter(tmp_path, JOB, flush_rows=4) as w:
        assert w.done_indices() == {0, 3, 5}
        assert not w.add(result(3))  # already done: dropped
        for i in range(6):
            if not w.is_done(i):
                w.add(result(i))
    res = finalize(tmp_path, 6)
    table = pq.read_table(res.path)
    assert table.column("index").to_pylist() == list(range(6))
    assert table.column("id").to_pylist() == [f"id{i}" for i in range(6)]
    assert (res.rows, res.errors) == (6, 0)


def test_crash_leftovers_are_ignored(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, JOB, flush_rows=2)
    for i in range(5):
        w.add(result(i))  # 0-3 flushed, 4 buffered
    crash(w)
    (work_dir(tmp_path) / ".shard-00002.parquet.tmp").write_bytes(b"PAR1 half a shard")
    w = ShardWriter(tmp_path, JOB, flush_rows=2)
    assert w.done_indices() == {0, 1, 2, 3}
    assert not list(tmp_path.glob(".*.tmp"))
    w.add(result(4))
    w.close()
    assert pq.read_table(finalize(tmp_path, 5).path).num_rows == 5


def test_a_damaged_shard_is_set_aside_and_redone(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=1) as w:
        w.add(result(0))
        w.add(result(1))
    shards(tmp_path)[1].write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable shard"), ShardWriter(tmp_path, JOB) as w:
        assert w.done_indices() == {0}
        w.add(result(1))
    assert pq.read_table(finalize(tmp_path, 2).path).num_rows == 2


def test_changed_job_is_refused_unless_overwrite(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB) as w:
        w.add(result(0))
    changed = {**JOB, "sampling": {"temperature": 0.7, "max_tokens": 8}}
    with pytest.raises(OutputDirError, match=r"sampling.temperature: 0.0 -> 0.7.*overwrite=true"):
        ShardWriter(tmp_path, changed)
    with pytest.raises(OutputDirError, match="n: 1 -> 2"):
        ShardWriter(tmp_path, JOB, n=2)
    with ShardWriter(tmp_path, changed, overwrite=True) as w:
        assert w.done_indices() == set() and not shards(tmp_path)
    assert (
        json.loads((work_dir(tmp_path) / "job.json").read_text())["job"]["sampling"]["temperature"]
        == 0.7
    )


def test_foreign_results_without_job_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / FINAL_FILE).write_bytes(b"x")
    with pytest.raises(OutputDirError, match="without a job.json"):
        ShardWriter(tmp_path, "abc123")


def test_two_writers_cannot_share_a_dir(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB), pytest.raises(OutputDirError, match="in use"):
        ShardWriter(tmp_path, JOB)
    ShardWriter(tmp_path, JOB).close()  # released on close


def test_rows_are_type_checked_for_n(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, n=2) as w:
        with pytest.raises(TypeError, match="completion must be list"):
            w.add(result(0, n=1))
        w.add(result(0, n=2))
    table = pq.read_table(finalize(tmp_path, 1).path)
    assert table.column("completion").to_pylist() == [["out0.0", "out0.1"]]


def test_finalize_names_missing_rows_and_writes_nothing(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB) as w:
        for i in (0, 2):
            w.add(result(i))
    with pytest.raises(IncompleteOutputError, match=r"2 of 4 rows .*indices 1, 3"):
        finalize(tmp_path, 4)
    assert not (tmp_path / FINAL_FILE).exists()


def test_finalize_drops_rows_past_the_total_and_duplicates(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=2) as w:
        for i in (3, 1, 0, 2):
            w.add(result(i))
    # A duplicate shard cannot come from the writer; finalize must still keep one copy.
    dup = pq.read_table(shards(tmp_path)[0])
    pq.write_table(
        dup.set_column(2, "prompt", pa.array(["dup"] * 2)),
        work_dir(tmp_path) / "shard-00009.parquet",
    )
    table = pq.read_table(finalize(tmp_path, 3).path)
    assert table.column("index").to_pylist() == [0, 1, 2]
    assert "dup" not in table.column("prompt").to_pylist()  # the first written copy wins


def test_finalize_in_buckets_matches_one_pass(tmp_path: Path) -> None:
    order = list(range(23))
    random.Random(0).shuffle(order)
    with ShardWriter(tmp_path, JOB, flush_rows=4) as w:
        for i in order:
            w.add(result(i))
    one = pq.read_table(finalize(tmp_path, 23).path)
    many = pq.read_table(finalize(tmp_path, 23, rows_per_bucket=5).path)
    assert one.equals(many) and one.column("index").to_pylist() == list(range(23))
    assert not (tmp_path / ".finalize.tmp").exists()


def test_finalize_zero_rows(tmp_path: Path) -> None:
    ShardWriter(tmp_path, JOB).close()
    table = pq.read_table(finalize(tmp_path, 0).path)
    assert table.num_rows == 0 and table.schema == output_schema(1)


def test_run_json(tmp_path: Path) -> None:
    path = write_run_json(
        tmp_path, {"model": {"path": "x"}}, {"elapsed_s": 1.5, "ttft_s": float("nan")}
    )
    assert path == str(tmp_path / "run.json")  # paths are strings: output_dir may be a URL
    data = json.loads(Path(path).read_text())
    assert data["config"]["model"]["path"] == "x"
    assert data["metrics"] == {"elapsed_s": 1.5, "ttft_s": None}
    assert {"torch", "triton", "transformers", "pyarrow", "batchpage"} <= set(data["versions"])
    assert data["versions"]["pyarrow"] == pa.__version__


class Killed(Exception):
    """Stands for kill -9 at one point of the write sequence."""


@given(
    n_rows=st.integers(1, 20),
    flush_rows=st.integers(1, 5),
    kills=st.lists(
        st.tuples(st.integers(0, 12), st.sampled_from(["idle", "mid-write", "before-link"])),
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=25, deadline=None)
def test_random_kills_never_lose_duplicate_or_corrupt(
    n_rows: int, flush_rows: int, kills: list[tuple[int, str]], seed: int
) -> None:
    """A local shard is written under a temporary name and linked into place (LocalStore's
    create_bytes): a kill while it is written leaves a torn temporary file, one before the link
    a whole one; neither is ever a shard, and the next writer removes them."""
    rng = random.Random(seed)
    real_link = os.link
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        for after, phase in [*kills, (None, "idle")]:  # the last run goes to the end
            w = ShardWriter(out, JOB, flush_rows=flush_rows, flush_seconds=1e9)
            assert not list(work_dir(out).glob(".*.tmp"))  # the last kill's leftovers are gone
            todo = [i for i in range(n_rows) if not w.is_done(i)] + rng.choices(range(n_rows), k=2)
            rng.shuffle(todo)  # done ones are offered again: the writer must drop them

            def killed_at_link(src: str, dst: str, phase: str = phase) -> None:
                # What the kill leaves: the temporary file (torn if it came mid-write), which
                # the store's own cleanup (its `finally`) would not get to remove.
                data = Path(src).read_bytes()
                torn = data[: len(data) // 2] if phase == "mid-write" else data
                Path(dst).with_name(
                    f".{Path(dst).name}.{rng.randrange(16**6):06x}.tmp"
                ).write_bytes(torn)
                raise Killed

            try:
                for step, i in enumerate(todo):
                    if after is not None and step == after:
                        # The next flush dies in the given phase (or we die right here).
                        if phase == "idle":
                            raise Killed
                        w.flush_rows = 1
                        with mock.patch.object(os, "link", killed_at_link):
                            w.add(result(i))
                            w.flush()
                    w.add(result(i))
                w.close()
            except Killed:
                crash(w)
            assert os.link is real_link
        written = [i for p in shards(out) for i in pq.read_table(p).column("index").to_pylist()]
        assert sorted(written) == list(range(n_rows))  # no duplicate in the shards themselves
        table = pq.read_table(finalize(out, n_rows).path)
        assert table.column("index").to_pylist() == list(range(n_rows))
        assert table.column("completion").to_pylist() == [f"out{i}" for i in range(n_rows)]


_CHILD = textwrap.dedent(
    """
    import sys, time
    from batchpage.output import ResultRow, ShardWriter
    out, total = sys.argv[1], int(sys.argv[2])
    job = {"model": "tiny"}
    with ShardWriter(out, job, flush_rows=3, flush_seconds=1e9) as w:
        print("ready", flush=True)
        for i in range(total):
            if not w.is_done(i):
                w.add(ResultRow(i, str(i), "p", f"c{i}", "stop", 1, 1, 0))
                time.sleep(0.002)
    """
)


def test_sigkill_at_random_moments_then_resume(tmp_path: Path) -> None:
    total, rng = 200, random.Random(1)
    cmd = [sys.executable, "-c", _CHILD, str(tmp_path), str(total)]
    for _ in range(2):
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.3))
        child.send_signal(signal.SIGKILL)
        child.wait()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    table = pq.read_table(finalize(tmp_path, total).path)
    assert table.column("completion").to_pylist() == [f"c{i}" for i in range(total)]


def test_extra_columns_keep_their_types_through_shards_and_finalize(tmp_path: Path) -> None:
    extra = pa.schema(
        [
            ("code", pa.string()),
            ("meta", pa.struct([("tags", pa.list_(pa.string())), ("score", pa.float64())])),
            ("when", pa.timestamp("us", tz="UTC")),
        ]
    )
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    with ShardWriter(tmp_path, {"job": 1}, flush_rows=1, extra_schema=extra) as w:
        for i in (1, 0):
            meta = {"tags": ["a", str(i)], "score": i / 2}
            w.add(
                ResultRow(
                    i, str(i), "p", "c", "stop", extra={"code": f"x{i}", "meta": meta, "when": when}
                )
            )
    table = pq.read_table(finalize(tmp_path, 2).path)
    assert table.schema == output_schema(1, extra)
    assert table.column("meta").to_pylist() == [
        {"tags": ["a", "0"], "score": 0.0},
        {"tags": ["a", "1"], "score": 0.5},
    ]
    assert table.column("when").to_pylist() == [when, when]
    with pytest.raises(OutputDirError, match="changed: extra"):
        ShardWriter(tmp_path, {"job": 1})  # the same job without the columns is another job


def test_extra_columns_may_not_shadow_batchpage_columns() -> None:
    with pytest.raises(ValueError, match=r"\['error'\] clash"):
        output_schema(1, pa.schema([("error", pa.string())]))
