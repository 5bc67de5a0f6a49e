"""ReplicaPool: N engine replicas on Ray behind LLM's generate() and pooling (embed, classify,
reward, score) contracts, so the job loop (and with it the output writer, resume and run.json)
is the same under both executors.

Each call (generate(prompts, params, on_output=..., on_step=...), or a pooling method with its
PoolingParams) puts the call's rows in the engine's prefix order, cuts that order into
contiguous windows (windows.py) and hands them out through a work queue (work_queue.py), each
to the least-loaded live replica; each replica holds at most `windows_per_replica` windows, so
memory is bounded by the windows in flight. Replicas stream finished rows back (replica.py);
each row reaches on_output exactly once, in the driver, which writes it as the local job does.

Each replica is a placement group of one bundle per tensor-parallel rank (its actor on bundle
0, its other ranks on the rest). A replica that dies (its process killed, its node lost, one of
its ranks gone) puts its undelivered rows back at the front of the queue for the others and is
replaced while executor.max_restarts allows; the job fails only when no replica is left.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from batchpage.distributed.ray_ranks import ray_cause
from batchpage.distributed.workers import WorkerDied
from batchpage.executor.config import ExecutorConfig, replica_bundles
from batchpage.executor.figures import CallStats, ReplicaFigures
from batchpage.executor.ray_cluster import Connection, connect
from batchpage.executor.replica import Replica, ReplicaUpdate
from batchpage.executor.windows import cut_windows, prefix_order
from batchpage.executor.work_queue import Window, WorkQueue, least_loaded
from batchpage.llm_pooling import score_pairs
from batchpage.lora.request import LoRARequest
from batchpage.metrics import RunStats
from batchpage.model.loader import load_tokenizer, resolve_model_source
from batchpage.pooling_params import PoolingParams
from batchpage.request_outputs import PoolingRequestOutput, RequestOutput
from batchpage.sampling_params import SamplingParams

Output = RequestOutput | PoolingRequestOutput
OnOutput = Callable[[Any, int], None]
OnStep = Callable[[RunStats], None]
log = logging.getLogger(__name__)

_WAIT_S = 1.0  # the longest the driver waits without reporting progress


class ReplicaPool:
    def __init__(self, model: str, executor: ExecutorConfig, **engine_args: Any) -> None:
        import ray

        self.cfg = executor
        self.schedule = engine_args.get("schedule", "prefix")
        # The driver tokenizes (the job's prompts are built here) but never loads weights.
        self.tokenizer = load_tokenizer(resolve_model_source(model))
        # Replicas may start in another folder, or on another node with the same files.
        where = str(Path(model).resolve()) if Path(model).exists() else model
        self.connection: Connection = connect(executor)
        ranks = engine_args.get("tensor_parallel_size", 1)
        # One placement group per replica, a bundle per rank: its ranks 1.. are Ray actors on
        # bundles 1.. (distributed/ray_ranks.py), on whichever nodes have room.
        self.bundles = replica_bundles(executor, ranks)
        if ranks > 1:
            engine_args = {**engine_args, "distributed_executor_backend": "ray"}
        self._remote = ray.remote(Replica)
        self._args = (where, engine_args, executor.cpus_per_replica)
        self.actors: list[Any] = []
        self.groups: list[Any] = []  # each actor's placement group
        for _ in range(executor.num_replicas):
            actor, group = self._spawn()
            self.actors.append(actor)
            self.groups.append(group)
        # Replicas started in place of lost ones, until they have loaded: describe ref ->
        # (actor, placement group).
        self._starting: dict[Any, tuple[Any, Any]] = {}
        self.restarts = 0  # replacements started over the job (executor.max_restarts)
        self.windows_redone = 0  # windows whose rows a lost replica left to the others
        try:
            infos = ray.get([a.describe.remote() for a in self.actors])
        except ray.exceptions.RayError as e:
            self.close()
            raise ValueError(f"a replica could not load {model}: {ray_cause(e)}") from None
        self.replicas = [ReplicaFigures(i, info) for i, info in enumerate(infos)]
        self.info = infos[0]
        self.plan = self.info["plan"]  # what `auto` became on the first replica
        self.model_config = self.info["model_config"]
        self.run_stats = RunStats(self.info["kv_blocks"], self.info["block_size"])
        self.requeued_rows = 0

    # --- LLM's contract -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[list[int] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        on_output: OnOutput | None = None,
        on_step: OnStep | None = None,
        lora_request: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """As LLM.generate: one output per prompt, in input order; on_output(output, index) as
        each row finishes (on any replica), on_step(stats) with the call's figures so far.
        `lora_request`: each prompt's adapter (None: the base model)."""
        ids = self._ids(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        else:
            params = list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(ids)} prompts")
        named = {} if lora_request is None else {"lora_request": list(lora_request)}
        return self._call("generate", ids, [ids, params], {}, on_output, on_step, named)

    def _pool(
        self,
        method: str,
        prompts: Sequence[list[int] | str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
        on_output: OnOutput | None = None,
        on_step: OnStep | None = None,
    ) -> list[PoolingRequestOutput]:
        """LLM.<method> (embed, classify, reward), the rows spread over the replicas as
        generate's are."""
        ids = self._ids(prompts)
        kwargs = {"pooling_params": pooling_params}
        return self._call(method, ids, [ids], kwargs, on_output, on_step)

    embed = functools.partialmethod(_pool, "embed")
    classify = functools.partialmethod(_pool, "classify")
    reward = functools.partialmethod(_pool, "reward")

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
        on_output: OnOutput | None = None,
        on_step: OnStep | None = None,
    ) -> list[PoolingRequestOutput]:
        """As LLM.score; pairs are ordered by their first text's tokens, so pairs that share a
        query run on one replica, next to each other."""
        firsts, seconds = score_pairs(data_1, data_2)
        keys = self._ids(firsts)
        kwargs = {"pooling_params": pooling_params}
        return self._call("score", keys, [firsts, seconds], kwargs, on_output, on_step)

    def _ids(self, prompts: Sequence[list[int] | str]) -> list[list[int]]:
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _call(
        self,
        method: str,
        keys: list[list[int]],
        columns: list[list[Any]],
        kwargs: dict[str, Any],
        on_output: OnOutput | None,
        on_step: OnStep | None,
        named: dict[str, list[Any]] | None = None,
    ) -> list[Any]:
        """Run LLM.<method>(*columns, **kwargs, **named) over the replicas, window by window:
        row i is (column[i] for each column, and named's), placed in the prefix order of keys[i]
        (an adapter's rows together first, when named holds lora_request)."""
        named = named or {}
        loras = named.get("lora_request")
        if loras is not None:  # the adapter's id leads the key: its rows go together
            ids = [0 if a is None else -a.lora_int_id for a in loras]
            keys = [[i, *k] for i, k in zip(ids, keys, strict=True)]
        order = prefix_order(keys, self.schedule)
        # A call smaller than the replicas' windows together is cut finer, so every live
        # replica gets a share of it (a contiguous run of the prefix order each).
        live = sum(not r.lost for r in self.replicas)
        size = min(self.cfg.window_rows, max(1, -(-len(order) // max(1, live))))
        windows = cut_windows([keys[p] for p in order], size)
        work = WorkQueue([order[i] for i in r] for r in windows)
        run = _Run(self, work, _Call(method, columns, kwargs, named), on_output, on_step)
        outputs = run.until_done()
        self.run_stats = run.stats.finish()
        self.requeued_rows += work.requeued_rows
        return outputs

    # --- what the job records -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Settings for run.json: what `auto` became on the replicas, and the executor with
        each replica's figures (throughput over its own generating time, prefix hit rate)."""
        keep = ("device", "dtype", "max_model_len", "kv_blocks", "kv_cache_bytes", "threads")
        return {
            **{k: self.info[k] for k in keep},
            "attention_backend": self.info["attention_backend"],
            "executor": {
                "kind": "ray",
                "address": self.connection.address,
                "num_replicas": self.cfg.num_replicas,
                "cpus_per_replica": self.cfg.cpus_per_replica,
                "gpus_per_replica": self.cfg.gpus_per_replica,
                "window_rows": self.cfg.window_rows,
                "replicas_lost": sum(r.lost for r in self.replicas),
                "replicas_replaced": self.restarts,
                "max_restarts": self.cfg.max_restarts,
                "windows_redone": self.windows_redone,
                "rows_requeued": self.requeued_rows,
                "replicas": [r.record() for r in self.replicas],
            },
        }

    def _spawn(self) -> tuple[Any, Any]:
        """A replica's actor on bundle 0 of a placement group of its own, and the group."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group(self.bundles, strategy="PACK")
        first = self.bundles[0]
        actor = self._remote.options(
            num_cpus=first["CPU"],
            num_gpus=first.get("GPU", 0),
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
        ).remote(*self._args)
        return actor, group

    def replace_lost(self) -> None:
        """Start a replica in place of a lost one while executor.max_restarts allows; it takes
        windows once it has loaded (admit_started)."""
        if self.restarts >= self.cfg.max_restarts:
            return
        self.restarts += 1
        actor, group = self._spawn()
        self._starting[actor.describe.remote()] = (actor, group)

    def admit_started(self, timeout_s: float = 0.0) -> None:
        """Replacements that finished loading join the pool (waiting up to timeout_s for one);
        one that failed to start counts as lost again."""
        import ray

        if not self._starting:
            return
        ready, _ = ray.wait(list(self._starting), num_returns=1, timeout=timeout_s)
        for ref in ready:
            actor, group = self._starting.pop(ref)
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError as e:
                log.warning("executor: a replacement replica did not start: %s", ray_cause(e))
                _end(actor, group)
                self.replace_lost()
                continue
            self.actors.append(actor)
            self.groups.append(group)
            self.replicas.append(ReplicaFigures(len(self.replicas), info))
            log.warning("executor: replica %d started in place of a lost one", len(self.actors) - 1)

    @property
    def starting(self) -> int:
        """Replacements still loading."""
        return len(self._starting)

    def replica_line(self) -> str:
        """The replicas now, for the progress bar: '2/2 live' (', 1 lost, 1 starting')."""
        lost = sum(r.lost for r in self.replicas)
        line = f"{len(self.replicas) - lost}/{len(self.replicas)} live"
        return (
            line
            + (f", {lost} lost" if lost else "")
            + (f", {self.starting} starting" if self.starting else "")
        )

    def summary(self) -> str:
        """One line: replicas lost, replaced and windows redone over the job."""
        lost = sum(r.lost for r in self.replicas)
        return (
            f"executor: {lost} of {len(self.replicas)} replicas lost, {self.restarts} "
            f"replacements started (executor.max_restarts={self.cfg.max_restarts}), "
            f"{self.windows_redone} windows redone ({self.requeued_rows} rows)"
        )

    @property
    def attention_name(self) -> str:
        return str(self.info["attention_backend"])

    def close(self) -> None:
        """Stop the replicas (and the Ray instance this job started)."""
        import ray

        if self.restarts or any(r.lost for r in self.replicas):
            log.warning(self.summary())
        for actor, group in [*zip(self.actors, self.groups, strict=True), *self._starting.values()]:
            _end(actor, group)
        self.actors, self.groups, self._starting = [], [], {}
        if self.connection.owned:
            ray.shutdown()


class _Call(NamedTuple):
    method: str  # an LLM method: generate, embed, classify, reward, score
    columns: list[list[Any]]  # its per-row arguments, one list each, as long as the call
    kwargs: dict[str, Any]  # its arguments shared by every row
    named: dict[str, list[Any]]  # its per-row keyword arguments (lora_request), a list each

    def window(self, positions: Sequence[int]) -> list[list[Any]]:
        return [[column[p] for p in positions] for column in self.columns]

    def named_window(self, positions: Sequence[int]) -> dict[str, list[Any]]:
        return {name: [column[p] for p in positions] for name, column in self.named.items()}


class _Run:
    """One call: dispatch windows, collect rows, handle dead replicas."""

    def __init__(
        self,
        pool: ReplicaPool,
        work: WorkQueue,
        call: _Call,
        on_output: OnOutput | None,
        on_step: OnStep | None,
    ) -> None:
        self.pool, self.work, self.call = pool, work, call
        self.on_output, self.on_step = on_output, on_step
        self.outputs: list[Output | None] = [None] * len(call.columns[0])
        self.stats = CallStats(pool.info["kv_blocks"], pool.info["block_size"])
        self.tasks: dict[Any, tuple[int, Window]] = {}  # generator -> (replica, window)

    def until_done(self) -> list[Output]:
        import ray

        while not self.work.finished:
            self.pool.admit_started()
            self._dispatch()
            if not self.tasks and self.pool.starting:  # nothing runs: wait for a replacement
                self.pool.admit_started(timeout_s=_WAIT_S)
                continue
            if not self.tasks:
                raise RuntimeError(
                    f"every replica died with {self.work.total - self.work.delivered} rows left; "
                    "finished rows are saved: rerun the same command to resume"
                )
            ready, _ = ray.wait(list(self.tasks), num_returns=1, timeout=_WAIT_S)
            for task in ready:
                if task in self.tasks:  # a death handled earlier in this loop drops it
                    self._advance(task)
            if self.on_step is not None:
                self.on_step(self.stats.current())
        return [out for out in self.outputs if out is not None]

    def _dispatch(self) -> None:
        """Hand waiting windows out, one at a time, each to the least-loaded live replica."""
        load = [0] * len(self.pool.replicas)
        for replica, _ in self.tasks.values():
            load[replica] += 1
        live = [not figures.lost for figures in self.pool.replicas]
        while (replica := least_loaded(load, live, self.pool.cfg.windows_per_replica)) is not None:
            window = self.work.take()
            if window is None:
                return
            task = (
                self.pool.actors[replica]
                .run.options(num_returns="streaming")
                .remote(
                    self.call.method,
                    self.call.window(window.positions),
                    self.call.kwargs,
                    self.call.named_window(window.positions),
                )
            )
            self.tasks[task] = (replica, window)
            load[replica] += 1

    def _advance(self, task: Any) -> None:
        import ray

        replica, window = self.tasks[task]
        try:
            update: ReplicaUpdate = ray.get(next(task))
        except StopIteration:
            del self.tasks[task]
            self.work.release(window.id)
            return
        except ray.exceptions.RayActorError:
            self._lose(replica)
            return
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, WorkerDied):  # one of its ranks died: the replica is lost
                log.warning("executor: replica %d lost a rank: %s", replica, ray_cause(e))
                self._lose(replica)
                return
            # The engine raised: a bug, not a lost node.
            raise RuntimeError(f"replica {replica} failed: {ray_cause(e)}") from e
        figures = self.pool.replicas[replica]
        for local, out in update.outputs:
            position = window.positions[local]
            if not self.work.deliver(window.id, position):
                continue
            self.outputs[position] = out
            figures.rows += 1
            if self.on_output is not None:
                self.on_output(out, position)
        if update.done:  # the generator ends next: the replica can take its next window now
            final = RunStats.from_record(update.stats, self.stats.block_size)
            final.first_token_s = update.first_token_s
            self.stats.close(window.id, final)
            figures.stats.append(final)
            figures.windows += 1
            del self.tasks[task]
            self.work.release(window.id)
        else:
            self.stats.update(window.id, update.stats)

    def _lose(self, replica: int) -> None:
        """The replica is gone: its windows' undelivered rows go back on the queue."""

        self.pool.replicas[replica].lost = True
        # Make sure (an unreachable one may come back), and free its bundles for a replacement.
        _end(self.pool.actors[replica], self.pool.groups[replica])
        for task, (owner, window) in list(self.tasks.items()):
            if owner == replica:
                del self.tasks[task]
                self.stats.close(window.id)
                if self.work.release(window.id):
                    self.pool.windows_redone += 1
        self.pool.replace_lost()


def _end(actor: Any, group: Any) -> None:
    """Kill a replica's actor and remove its placement group (ending its other ranks)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    ray.kill(actor)
    remove_placement_group(group)
