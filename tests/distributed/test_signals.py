"""SIGINT and SIGTERM sent to the driver of a tensor_parallel_size=2 job: it exits 130 / 143
within STOP_BOUND_S with its worker gone, the rows finished so far are saved, and the rerun
resumes, every row once, equal to a one-rank run.

The signal lands at a known moment through a hook (tests.job.test_run_cli.hooked_cli): between
two steps, or inside one, rank 0 paused just before an all-reduce that rank 1 already waits in
(where a job spends most of its time, and where an interrupted driver used to hang at exit).
Ctrl-C in a terminal signals the whole process group, the worker too: a case of its own. The
two ways an engine closes its ranks are also checked in-process, without a job."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from batchpage import LLM, SamplingParams
from batchpage.distributed.workers import TensorParallelWorkers
from batchpage.job import run_job
from batchpage.run import compose_job
from tests.executor.cluster_nodes import descendants, running
from tests.executor.jobs import shard_indices
from tests.job.test_run_cli import (
    cli,
    compared,
    hooked_cli,
    pause_after,
    tiny_job_args,
    write_prompts,
)
from tests.model_factory import build_hf_model, save_hf_folder

ROWS = 24
PAUSE_AT = 3  # rows saved before the signal
STOP_BOUND_S = 10.0  # from the signal to the driver's exit, its workers ended
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
MESSAGE = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def pause_mid_step(rows: int) -> str:
    """A hook for hooked_cli: once `rows` rows are saved, rank 0 says PAUSED on stdout just
    before its next all-reduce and waits for a signal (whose exception is raised there, in the
    middle of the forward); its other ranks, separate processes, are already waiting in it."""
    return f"""
    import os, signal
    from batchpage.distributed import workers
    from batchpage.output.writer import ShardWriter
    make, add, done = workers.shared_memory_collective, ShardWriter.add, [0]
    def add_counted(self, row):
        added = add(self, row)
        done[0] = self.num_done
        return added
    def pausing_collective(*args):
        comm = make(*args)
        reduce = comm.all_reduce_
        def pause_then_reduce(x):
            if done[0] >= {rows}:
                os.write(1, b"PAUSED\\n")
                while True:
                    signal.pause()
            return reduce(x)
        comm.all_reduce_ = pause_then_reduce
        return comm
    ShardWriter.add = add_counted
    workers.shared_memory_collective = pausing_collective
    """


def wait_for_pause(proc: subprocess.Popen, log: Path) -> None:
    """Returns once the hook printed PAUSED (library messages share stdout); fails if the job
    ended first."""
    assert proc.stdout is not None
    lines = [proc.stdout.readline()]
    while lines[-1] not in ("PAUSED\n", ""):
        lines.append(proc.stdout.readline())
    assert lines[-1] == "PAUSED\n", (lines, log.read_text()[-3000:])


def signal_and_time(proc: subprocess.Popen, sig: int, whole_group: bool, patience: float) -> float:
    """Sends `sig` to the driver (or, whole_group, to its process group, as a terminal's Ctrl-C
    does); the seconds until it exited. Past `patience` the group is killed and the test fails."""
    start = time.monotonic()
    if whole_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=patience)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the job did not exit within {patience:g} s of signal {sig}")
    return time.monotonic() - start


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("signals") / "d.jsonl", ROWS)


def job_args(data: Path, model: Path, out: Path) -> list[str]:
    return [
        *tiny_job_args(data, model, out),
        "dataset.window_rows=4",
        "flush_rows=1",
        "sampling.max_tokens=6",
    ]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_folder, prompts) -> list[dict]:
    """The same job on one rank, uninterrupted: what every row must be."""
    out = tmp_path_factory.mktemp("one") / "out"
    run_job(compose_job(job_args(prompts, tiny_folder, out)))
    return compared(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "mid_step", "whole_group"),
    [
        (signal.SIGINT, True, False),
        (signal.SIGTERM, True, False),
        (signal.SIGTERM, False, False),
        (signal.SIGINT, True, True),
    ],
    ids=["sigint-mid-step", "sigterm-mid-step", "sigterm-between-steps", "ctrl-c-to-the-group"],
)
def test_a_signal_ends_a_two_rank_job_promptly_and_the_rerun_resumes(
    tmp_path: Path,
    tiny_folder: Path,
    prompts: Path,
    one_rank: list[dict],
    sig: int,
    mid_step: bool,
    whole_group: bool,
) -> None:
    out = tmp_path / "out"
    args = [*job_args(prompts, tiny_folder, out), "engine.tensor_parallel_size=2"]
    hook = pause_mid_step(PAUSE_AT) if mid_step else pause_after(PAUSE_AT)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = hooked_cli(
            hook, args, tmp_path, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
    try:
        wait_for_pause(proc, log)
        workers = descendants(proc.pid)
        assert len(running(workers)) == 1, workers  # rank 1
        seconds = signal_and_time(proc, sig, whole_group, patience=60.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = log.read_text()
    assert proc.returncode == EXIT[sig], err
    assert seconds < STOP_BOUND_S, (seconds, err)
    assert running(workers) == [], f"a tensor-parallel worker outlived the job:\n{err}"
    assert f"{MESSAGE[sig]}: finished rows are saved; rerun with output_dir={out}" in err
    assert "Traceback" not in err, err
    saved = shard_indices(out)
    assert len(saved) == len(set(saved)) and PAUSE_AT <= len(saved) < ROWS, saved

    rerun = cli(args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, rerun_err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, rerun_err
    assert f"{len(saved)} rows already done" in rerun_err
    rows = compared(out)
    assert [r["index"] for r in rows] == list(range(ROWS))
    assert rows == one_rank


def closed_within(workers: TensorParallelWorkers, seconds: float) -> bool:
    """workers.close() in a thread; False when it took longer than `seconds` (its ranks are
    then killed, which unblocks it)."""
    thread = threading.Thread(target=workers.close, daemon=True)
    thread.start()
    thread.join(seconds)
    if not thread.is_alive():
        return True
    for proc in workers.ranks.procs:
        proc.kill()
    thread.join()
    return False


def test_close_tells_ranks_between_steps_and_ends_those_left_inside_one(
    tmp_path: Path, tokenizer
) -> None:
    """After a step that finished, rank 1 waits for the next one: close tells it to return (it
    exits 0). After an exception inside rank 0's forward (an interrupt, raised here by rank 0's
    all-reduce), rank 1 waits in that all-reduce: close ends it with SIGTERM, at once."""
    hf = build_hf_model("llama_gqa_tied", vocab_size=len(tokenizer))
    folder = save_hf_folder(hf, tmp_path / "tiny", tokenizer)
    prompts = [{"prompt_token_ids": [5, 17, 33, 9]}]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def engine() -> LLM:
        return LLM(str(folder), tensor_parallel_size=2, dtype="float32", kv_cache_memory=4 << 20)

    finished = engine()
    assert finished.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert finished.workers is not None
    worker = finished.workers.ranks.procs[0]
    assert closed_within(finished.workers, STOP_BOUND_S)
    assert worker.returncode == 0

    cut = engine()
    assert cut.workers is not None

    def interrupted(x: object) -> object:
        raise KeyboardInterrupt

    cut.workers.comm.all_reduce_ = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        cut.generate(prompts, params, use_tqdm=False)
    worker = cut.workers.ranks.procs[0]
    assert closed_within(cut.workers, STOP_BOUND_S), "close waited on a rank inside a step"
    assert worker.returncode == -signal.SIGTERM
