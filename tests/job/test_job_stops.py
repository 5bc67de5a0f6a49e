"""A job that stops part-way on what happens outside it: an input file changed while it ran, or
a full disk while writing a shard or the final merge. Each stops with one JobStoppedError line
(exit 2 on the command line), keeps what was saved, and a rerun resumes to a clean run's rows."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.parquet as pq
import pytest

from batchpage import LLM
from batchpage.job import run_job
from batchpage.job.plan import JobStoppedError
from batchpage.output import work_dir
from batchpage.storage import LocalStore
from tests.job.test_loop import COMPARED, job, never, prompts, table, write_jsonl


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder: Path) -> LLM:
    """One engine for every run of this module (the job's LLM settings of tests.job.test_loop)."""
    return LLM(str(tiny_folder), dtype="float32", kv_cache_memory=2**22, max_model_len=256)


class AfterFirstWindow:
    """An LLM factory whose generate() calls `event` once, right after the first window's rows
    are generated and saved: the moment the test changes the world."""

    def __init__(self, llm: LLM, event: Callable[[], None]) -> None:
        self.llm, self.event, self.windows = llm, event, 0

    def __call__(self, model: str, **engine: Any) -> Any:
        parent = self

        class Wrapped:
            def __getattr__(self, name: str) -> Any:
                return getattr(parent.llm, name)

            def generate(self, *args: Any, **kwargs: Any) -> Any:
                outs = parent.llm.generate(*args, **kwargs)
                parent.windows += 1
                if parent.windows == 1:
                    parent.event()
                return outs

        return Wrapped()


def saved_indices(out: Path) -> list[int]:
    shards = work_dir(out).glob("shard-*.parquet")
    return sorted(i for s in shards for i in pq.read_table(s)["index"].to_pylist())


def truncate(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: len(lines) // 2]))


def rewrite_in_place(path: Path) -> None:
    """The same size, new prompts (a writer that rewrites the file through the same inode)."""
    text = path.read_text()
    with open(path, "r+") as f:
        f.write(text.replace("quick", "QUICK"))


def rewrite_keeping_mtime(path: Path) -> None:
    st = path.stat()
    rewrite_in_place(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (truncate, r"size \d+ -> \d+ bytes"),
        (rewrite_in_place, "it was modified"),
        (rewrite_keeping_mtime, "its contents differ"),
    ],
)
def test_an_input_changed_mid_run_stops_the_job_naming_the_file(
    tmp_path: Path, tiny_llm: LLM, tiny_folder: Path, change: Callable[[Path], None], message: str
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(12))
    original = data.read_bytes()
    out = tmp_path / "out"
    cfg = job(data, tiny_folder, out, dataset={"window_rows": 4}, flush_rows=1)
    factory = AfterFirstWindow(tiny_llm, lambda: change(data))
    with pytest.raises(JobStoppedError, match=rf"input file {data} changed .*{message}") as err:
        run_job(cfg, factory)
    assert "\n" not in str(err.value)
    assert not (out / "completions.parquet").exists()  # the job did not finish on a mix
    saved = saved_indices(out)
    if change is rewrite_keeping_mtime:  # only the digest at the end can see this one
        assert "overwrite=true" in str(err.value) and saved == list(range(12))
        return
    # The window read after the change was never generated; the first one is kept.
    assert saved == [0, 1, 2, 3] and factory.windows == 1
    first = pq.read_table(work_dir(out) / "shard-00000.parquet")["prompt"].to_pylist()
    assert all("quick" in p for p in first)
    data.write_bytes(original)  # restored: the rerun resumes
    result = run_job(cfg, lambda *a, **k: tiny_llm)
    assert (result.rows_resumed, result.rows_generated) == (4, 8)
    run_job(job(data, tiny_folder, tmp_path / "clean"), lambda *a, **k: tiny_llm)
    clean = [{k: r[k] for k in COMPARED} for r in table(tmp_path / "clean")]
    assert [{k: r[k] for k in COMPARED} for r in table(out)] == clean


def test_a_touched_input_with_the_same_bytes_is_no_change(
    tmp_path: Path, tiny_llm: LLM, tiny_folder: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(8))
    cfg = job(data, tiny_folder, tmp_path / "out", dataset={"window_rows": 4})
    result = run_job(cfg, AfterFirstWindow(tiny_llm, lambda: os.utime(data)))
    assert result.rows == 8 and result.rows_generated == 8


def disk_full(path: object = "") -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


@contextlib.contextmanager
def full_after(real: Callable[..., Any], calls: int) -> Iterator[Callable[..., Any]]:
    """`real`, a Store method writing (self, path, ...), that raises ENOSPC naming the path from
    its (calls + 1)-th call on."""
    made = 0

    def write(*args: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        if made > calls:
            raise disk_full(args[1] if len(args) > 1 else "")
        return real(*args, **kwargs)

    yield write


def test_a_full_disk_while_writing_a_shard_stops_keeps_and_resumes(
    tmp_path: Path, tiny_llm: LLM, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(10))
    out = tmp_path / "out"
    cfg = job(data, tiny_folder, out, flush_rows=2)
    with full_after(LocalStore.create_bytes, 2) as failing:  # how shards are written
        monkeypatch.setattr(LocalStore, "create_bytes", failing)
        with pytest.raises(JobStoppedError, match=r"no space left on the device of .*out") as err:
            run_job(cfg, lambda *a, **k: tiny_llm)
    message = str(err.value)
    assert "4 rows are saved" in message and "rerun with the same output_dir" in message
    assert saved_indices(out) == [0, 1, 2, 3]
    assert not list(out.glob(".*.tmp"))
    monkeypatch.undo()
    result = run_job(cfg, lambda *a, **k: tiny_llm)
    assert (result.rows_resumed, result.rows_generated) == (4, 6)
    assert [r["index"] for r in table(out)] == list(range(10))


def test_a_full_disk_in_the_final_merge_stops_and_the_rerun_merges(
    tmp_path: Path, tiny_llm: LLM, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(5))
    out = tmp_path / "out"
    cfg = job(data, tiny_folder, out)
    real = LocalStore.write_stream

    @contextlib.contextmanager
    def fills_up(store: LocalStore, path: str) -> Iterator[BinaryIO]:
        with real(store, path) as f:
            yield f  # the merge writes its rows, then the disk is full at the end
            if Path(path).name == "completions.parquet":
                raise disk_full(path)

    monkeypatch.setattr(LocalStore, "write_stream", fills_up)
    with pytest.raises(JobStoppedError, match="5 rows are saved"):
        run_job(cfg, lambda *a, **k: tiny_llm)
    assert not (out / "completions.parquet").exists() and not list(out.glob(".*.tmp"))
    monkeypatch.undo()
    result = run_job(cfg, never)  # every row is saved: nothing to generate, the merge is done
    assert result.rows == 5 and result.rows_resumed == 5
