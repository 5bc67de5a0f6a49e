"""What an output_dir holds after a crash or an overwrite, a damaged job.json, and file modes."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchpage.fileio import atomic_dir, atomic_path, atomic_write_text
from batchpage.output import (
    FINAL_FILE,
    SUCCESS_FILE,
    OutputDirError,
    ResultRow,
    ShardWriter,
    finalize,
    work_dir,
)
from batchpage.output.files import BATCH_ERRORS_FILE, BATCH_OUTPUT_FILE, SCORES_FILE

JOB = {"model": "tiny", "sampling": {"temperature": 0.0}, "dataset": "fp1"}


def rows(writer: ShardWriter, count: int) -> None:
    for i in range(count):
        writer.add(ResultRow(i, f"id{i}", f"p{i}", f"out{i}", "stop", 3, 2, 0, None))


def test_leftovers_of_every_write_are_removed_by_the_next_writer(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=1) as w:
        rows(w, 2)
    finalize(tmp_path, 2)
    # What kill -9 leaves in the middle of the final merge, the batch files, scoring, run.json
    # and a bucketed merge (atomic_path's ".<name>.<random>.tmp" names; finalize's folder).
    left = [
        f".{FINAL_FILE}.a1b2c3.tmp",
        f".{BATCH_OUTPUT_FILE}.d4e5f6.tmp",
        f".{BATCH_ERRORS_FILE}.0a0b0c.tmp",
        f".{SCORES_FILE}.123456.tmp",
        ".run.json.abcdef.tmp",
        ".job.json.fedcba.tmp",
    ]
    for name in left:
        (tmp_path / name).write_bytes(b"half a file")
    (tmp_path / ".finalize.x1y2.tmp").mkdir()
    (tmp_path / ".finalize.x1y2.tmp" / "b000000000-s000000000.parquet").write_bytes(b"PAR1")
    (tmp_path / "notes.tmp").write_text("the user's")  # not ours: kept
    ShardWriter(tmp_path, JOB).close()
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == []
    assert (tmp_path / "notes.tmp").exists() and (tmp_path / FINAL_FILE).exists()


def test_overwrite_deletes_every_file_of_the_old_job(tmp_path: Path) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=1) as w:
        rows(w, 2)
    finalize(tmp_path, 2)
    for name in (BATCH_OUTPUT_FILE, BATCH_ERRORS_FILE, SCORES_FILE):
        (tmp_path / name).write_text("old job's\n")
    changed = {**JOB, "sampling": {"temperature": 0.7}}
    with pytest.raises(OutputDirError, match="overwrite=true"):
        ShardWriter(tmp_path, changed)
    ShardWriter(tmp_path, changed, overwrite=True).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".batchpage"]
    assert sorted(p.name for p in work_dir(tmp_path).iterdir()) == ["job.json", "job.lock"]


def test_old_batch_or_score_files_without_job_json_are_refused(tmp_path: Path) -> None:
    (tmp_path / SCORES_FILE).write_text("someone's")
    with pytest.raises(OutputDirError, match="without a job.json"):
        ShardWriter(tmp_path, JOB)


@pytest.mark.parametrize("damage", [b'{"fingerprint": "ab', b"[1, 2]", b"\xff\xfe\x00", b""])
def test_a_damaged_job_json_names_the_file_and_the_fix(tmp_path: Path, damage: bytes) -> None:
    with ShardWriter(tmp_path, JOB, flush_rows=1) as w:
        rows(w, 2)
    (work_dir(tmp_path) / "job.json").write_bytes(damage)
    with pytest.raises(OutputDirError) as err:
        ShardWriter(tmp_path, JOB)
    message = str(err.value)
    assert str(work_dir(tmp_path) / "job.json") in message and "damaged" in message
    assert "overwrite=true" in message and "another output_dir" in message
    assert "\n" not in message
    with ShardWriter(tmp_path, JOB, overwrite=True) as w:  # the fix it names works
        assert w.num_done == 0
        rows(w, 1)
    assert finalize(tmp_path, 1).rows == 1


def test_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        with atomic_path(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"y")
        with atomic_dir(tmp_path / "folder") as d:
            assert d is not None
            (d / "f").write_text("z")
        with ShardWriter(tmp_path / "out", JOB, flush_rows=1) as w:
            rows(w, 1)
        finalize(tmp_path / "out", 1)
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.txt", "x")
    finally:
        os.umask(old)
    made = [*tmp_path.iterdir(), *tmp_path.glob("out/*"), *tmp_path.glob("out/.batchpage/*")]
    mode = {p.name: p.stat().st_mode & 0o777 for p in made}
    assert mode["a.txt"] == mode["b.bin"] == 0o644
    assert mode["folder"] == 0o755
    assert mode["job.json"] == mode[FINAL_FILE] == mode["shard-00000.parquet"] == 0o644
    assert mode["private.txt"] == 0o600


def test_the_top_level_holds_what_users_read_and_old_folders_resume(tmp_path: Path) -> None:
    """Shards, job.json and the lock live in .batchpage/ (which pyarrow's dataset reader skips,
    as it skips the commit point _SUCCESS: the folder reads as completions.parquet alone); a
    folder written with them at the top is adopted by the next writer, which resumes its rows."""
    with ShardWriter(tmp_path, JOB, flush_rows=1) as w:
        rows(w, 2)
    finalize(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".batchpage", SUCCESS_FILE, FINAL_FILE]
    assert pq.read_table(tmp_path).num_rows == 2  # the folder as one Parquet dataset
    old = tmp_path / "old"
    with ShardWriter(old, JOB, flush_rows=1) as w:
        rows(w, 1)
    for p in work_dir(old).iterdir():  # as an older batchpage laid it out
        if p.name != "job.lock":
            p.rename(old / p.name)
    with ShardWriter(old, JOB, flush_rows=1) as w:
        assert w.num_done == 1
        rows(w, 2)
    assert finalize(old, 2).rows == 2
    assert sorted(p.name for p in old.iterdir()) == [".batchpage", SUCCESS_FILE, FINAL_FILE]
