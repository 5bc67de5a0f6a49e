"""executor=ray on a local Ray instance with 2 replicas of the tiny model: the same
completions.parquet as executor=local (greedy and seeded sampling), error rows as locally,
run.json's per-replica figures, and a replica killed mid-job costing no row."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from batchpage.executor.ray_executor import ReplicaPool
from batchpage.job import run_job
from batchpage.run import compose_job
from tests.executor.jobs import (
    compared,
    job,
    job_args,
    ray_args,
    run_json,
    shard_indices,
    write_rows,
)
from tests.job.test_batch_invariant_job import answers, args, columns, requests
from tests.job.test_loop import write_jsonl


def local_and_ray(tmp_path, tiny_folder, *extra: str, rows: int = 16) -> tuple[list, list]:
    data = write_rows(tmp_path / "d.jsonl", rows)
    local = job(job_args(data, tiny_folder, tmp_path / "local", *extra))
    run_job(local)
    ray = job(job_args(data, tiny_folder, tmp_path / "ray", *extra, *ray_args()))
    run_job(ray)
    return compared(tmp_path / "local"), compared(tmp_path / "ray")


def test_two_replicas_give_the_local_output_with_error_rows(
    tmp_path, tiny_folder, ray_instance
) -> None:
    # Two input windows, each cut into windows of 3 rows for the replicas.
    local, ray = local_and_ray(tmp_path, tiny_folder, "dataset.window_rows=8")
    assert ray == local
    assert [r["index"] for r in ray] == list(range(16))
    failed = [r["index"] for r in ray if r["error"] is not None]
    assert failed == [1, 4, 7] and "max_model_len" in ray[7]["error"]
    assert "temperature" in ray[4]["error"]
    assert all(r["completion"] for r in ray if r["error"] is None)

    report = run_json(tmp_path / "ray")
    executor = report["runs"][-1]["settings"]["executor"]
    assert executor["kind"] == "ray" and executor["num_replicas"] == 2
    replicas = executor["replicas"]
    assert len(replicas) == 2 and all(r["windows"] >= 1 for r in replicas)
    assert len({r["pid"] for r in replicas}) == 2 and not executor["replicas_lost"]
    # Every row sent to an engine came back from exactly one replica; the totals add them up.
    assert sum(r["rows"] for r in replicas) == report["runs"][-1]["rows_generated"]
    totals = report["metrics"]
    assert sum(r["generated_tokens"] for r in replicas) == totals["generated_tokens"] > 0
    assert sum(r["cached_prompt_tokens"] for r in replicas) == totals["cached_prompt_tokens"]
    assert all(0.0 <= r["prefix_hit_rate"] <= 1.0 for r in replicas)
    assert all(r["output_tokens_per_s"] > 0 for r in replicas)
    assert report["config"]["resolved"]["threads"] == 1
    # progress.json (run.json names it): the job's last state, with each replica's figures.
    state = json.loads((tmp_path / "ray" / report["config"]["progress_file"]).read_text())
    assert state["stage"] == "done" and state["rows_done"] == 16 and state["rows_failed"] == 3
    assert [r["rows"] for r in state["executor"]["replicas"]] == [r["rows"] for r in replicas]
    assert run_json(tmp_path / "local")["runs"][-1]["settings"]["executor"] == {"kind": "local"}


def test_a_job_smaller_than_a_window_still_runs_on_every_replica(
    tmp_path, tiny_folder, ray_instance
) -> None:
    """6 rows and windows of 64: cut into one window per replica, each replica gets one (the
    least-loaded first), and the output is the local job's. (Before, replica 0 took the one
    window of 6 rows and replica 1 idled.)"""
    data = write_rows(tmp_path / "d.jsonl", 6, bad=False)
    local = job(job_args(data, tiny_folder, tmp_path / "local"))
    run_job(local)
    ray = job(job_args(data, tiny_folder, tmp_path / "ray", *ray_args(window_rows=64)))
    run_job(ray)
    assert compared(tmp_path / "ray") == compared(tmp_path / "local")
    replicas = run_json(tmp_path / "ray")["runs"][-1]["settings"]["executor"]["replicas"]
    # Cut where neighbours share least, within half a window of 3 rows each.
    assert all(r["rows"] >= 2 for r in replicas) and sum(r["rows"] for r in replicas) == 6
    assert [r["windows"] for r in replicas] == [1, 1]


@pytest.mark.slow
def test_seeded_sampling_is_the_same_on_replicas(tmp_path, tiny_folder, ray_instance) -> None:
    local, ray = local_and_ray(
        tmp_path,
        tiny_folder,
        "sampling=default",
        "sampling.temperature=1.0",
        "sampling.n=2",
        "sampling.seed=7",
        rows=12,
    )
    assert ray == local
    assert len({c for r in ray if r["completion"] for c in r["completion"]}) > 9  # they differ


class KillsReplicas(ReplicaPool):
    """Kills (SIGKILL) the processes of the replicas `victims` (all the pool started with when
    None) when the first row of any call (generate or a pooling method: they share _call)
    arrives, while they hold windows."""

    victims: tuple[int, ...] | None = None
    killed = False

    def _call(self, method: str, keys: Any, columns: Any, kwargs: Any, on_output: Any,
              on_step: Any, named: Any = None) -> Any:  # fmt: skip
        victims = range(len(self.replicas)) if self.victims is None else self.victims
        pids = [self.replicas[i].info["pid"] for i in victims]

        def killing(out: Any, index: int) -> None:
            if not self.killed:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                self.killed = True
            on_output(out, index)

        return super()._call(method, keys, columns, kwargs, killing, on_step, named)


class KillsReplicaZero(KillsReplicas):
    victims = (0,)


@pytest.mark.slow
def test_a_replica_killed_mid_job_costs_no_row(tmp_path, tiny_folder, ray_instance) -> None:
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    args = job_args(data, tiny_folder, tmp_path / "ray", "flush_rows=2", *ray_args(),
                    "executor.max_restarts=0")  # fmt: skip
    cfg = job(args)
    run_job(cfg, lambda model, **engine: KillsReplicaZero(model, cfg.executor, **engine))
    indices = shard_indices(tmp_path / "ray")
    assert sorted(indices) == list(range(24)), "a row was lost or written twice"
    executor = run_json(tmp_path / "ray")["runs"][-1]["settings"]["executor"]
    assert executor["replicas_lost"] == 1 and executor["rows_requeued"] >= 1
    assert [r["lost"] for r in executor["replicas"]] == [True, False]

    run_job(job(job_args(data, tiny_folder, tmp_path / "local")))
    assert compared(tmp_path / "ray") == compared(tmp_path / "local")


@pytest.mark.slow
def test_lost_replicas_are_replaced_up_to_max_restarts(tmp_path, tiny_folder, ray_instance) -> None:
    data = write_rows(tmp_path / "d.jsonl", 24, bad=False)
    out = tmp_path / "ray"
    cfg = job(
        job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(), "executor.max_restarts=1")
    )
    run_job(cfg, lambda model, **engine: KillsReplicas(model, cfg.executor, **engine))
    assert sorted(shard_indices(out)) == list(range(24)), "a row was lost or written twice"
    executor = run_json(out)["runs"][-1]["settings"]["executor"]
    assert executor["replicas_lost"] == 2 and executor["replicas_replaced"] == 1
    assert executor["windows_redone"] >= 1 and executor["rows_requeued"] >= 1
    replicas = executor["replicas"]
    assert [r["lost"] for r in replicas] == [True, True, False]
    assert replicas[2]["rows"] >= 1  # the replacement finished what the others left
    run_job(job(job_args(data, tiny_folder, tmp_path / "local")))
    assert compared(out) == compared(tmp_path / "local")

    # Without restarts the same losses leave no replica: one line, and the rows saved so far.
    out = tmp_path / "none"
    cfg = job(
        job_args(data, tiny_folder, out, "flush_rows=2", *ray_args(), "executor.max_restarts=0")
    )
    with pytest.raises(RuntimeError, match=r"every replica died with \d+ rows left.*resume"):
        run_job(cfg, lambda model, **engine: KillsReplicas(model, cfg.executor, **engine))


@pytest.mark.slow
def test_batch_invariant_replicas_write_what_one_local_engine_writes(
    tmp_path, tiny_folder, ray_instance
) -> None:
    """engine.batch_invariant=true: two replicas (each row beside other rows than on one
    engine; the test's Ray instance has two CPUs) write an OpenAI Batch file's answers,
    logprobs and seeded samples, byte for byte."""
    data = write_jsonl(tmp_path / "batch.jsonl", requests(18))
    local, ray = tmp_path / "local", tmp_path / "ray"
    run_job(compose_job(args(data, tiny_folder, local)))
    run_job(compose_job(args(data, tiny_folder, ray, "executor=ray", "executor.num_replicas=2",
                             "executor.window_rows=2")))  # fmt: skip
    assert answers(ray) == answers(local)
    assert columns(ray) == columns(local)


def test_more_replicas_than_the_cluster_holds_are_refused_before_loading(
    tmp_path, tiny_folder, ray_instance
) -> None:
    """Three one-CPU replicas on a two-CPU instance: one line naming the fix, not a job that
    waits without end for room Ray will never have."""
    data = write_rows(tmp_path / "d.jsonl", 4, bad=False)
    cfg = job(job_args(data, tiny_folder, tmp_path / "out", *ray_args(3)))
    with pytest.raises(ValueError, match=r"num_replicas=3 replicas need 3 CPUs .* has 2 and 0"):
        run_job(cfg)


def test_lora_rows_on_replicas_give_the_local_output(tmp_path, tiny_folder, ray_instance) -> None:
    """dataset.lora_column on two replicas: each row with its adapter, as on one engine."""
    from transformers import AutoModelForCausalLM

    from tests.job.test_lora_job import PROMPTS, lora_job
    from tests.lora.peft_adapters import make_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_folder)
    make_adapter(base, tmp_path / "a", seed=1)
    make_adapter(base, tmp_path / "b", seed=2)
    names = ["a", None, str(tmp_path / "b"), "a", None, str(tmp_path / "b")] * 2
    rows = [{"prompt": PROMPTS[i % 4], "adapter": n} for i, n in enumerate(names)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    outs = []
    for name, executor in (("local", None), ("ray", ray_args())):
        cfg = lora_job(data, tiny_folder, tmp_path / name, tmp_path / "a")
        cfg.model.loras = {"a": str(tmp_path / "a")}
        if executor is not None:
            cfg.executor.kind, cfg.executor.num_replicas, cfg.executor.window_rows = "ray", 2, 2
        run_job(cfg)
        outs.append(compared(tmp_path / name))
    assert outs[1] == outs[0]
    assert all(r["error"] is None for r in outs[0])
