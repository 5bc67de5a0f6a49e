"""One engine replica: the body of a Ray actor that holds one LLM and runs windows of rows
through one of its methods (generate, or a pooling method).

`run` is a streaming generator: the engine runs in a thread of the actor and each finished row
is yielded to the driver as soon as it is there (batched with whatever else finished meanwhile,
plus the window's figures so far), so the driver saves rows while the window still runs and a
replica that dies costs only its rows not yet delivered. The executor wraps the class with
ray.remote; Ray is imported here only to say where the replica runs.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpage.metrics import RunStats
from batchpage.request_outputs import PoolingRequestOutput, RequestOutput

# Figures go to the driver at least this often while rows are slow, for its progress bar.
_STATS_EVERY_S = 0.5


@dataclass
class ReplicaUpdate:
    # (row position in the window, its output)
    outputs: list[tuple[int, RequestOutput | PoolingRequestOutput]]
    stats: dict[str, float | int]  # RunStats.to_record() of the window so far
    done: bool = False
    first_token_s: list[float] = field(default_factory=list)  # with done: the window's TTFTs


class Replica:
    def __init__(self, model: str, engine_args: dict[str, Any], threads: int) -> None:
        import torch

        from batchpage.llm import LLM

        torch.set_num_threads(threads)  # before the model loads: the kernel build reads it
        self.threads = threads
        self.llm = LLM(model, **engine_args)

    def describe(self) -> dict[str, Any]:
        """Where this replica runs (its ranks' Ray nodes too) and what `auto` became there."""
        import ray

        plan = self.llm.plan
        node_id = str(ray.get_runtime_context().get_node_id())
        workers = self.llm.workers
        return {
            "plan": plan,
            "node": socket.gethostname(),
            "node_id": node_id,
            "rank_nodes": [node_id, *(workers.ranks.nodes() if workers else [])],
            "pid": os.getpid(),
            "device": str(plan.device),
            "dtype": str(plan.dtype).removeprefix("torch."),
            "kv_blocks": plan.num_blocks,
            "kv_cache_bytes": plan.kv_cache_bytes,
            "max_model_len": plan.max_model_len,
            "block_size": self.llm.config.block_size,
            "attention_backend": type(self.llm.engine.runner.attention).__name__,
            "threads": self.threads,
            "model_config": self.llm.model_config,
        }

    def run(
        self,
        method: str,
        columns: Sequence[Sequence[Any]],
        kwargs: dict[str, Any],
        named: dict[str, list[Any]] | None = None,
    ) -> Iterator[ReplicaUpdate]:
        """One window through LLM.<method>(*columns, **kwargs, **named) (generate: prompts
        and their SamplingParams, and per-row lora_request in named; a pooling method:
        prompts, or score's two texts, and PoolingParams); yields ReplicaUpdates as rows
        finish, the last with done=True."""
        call = getattr(self.llm, method)
        events: queue.Queue[tuple[str, Any]] = queue.Queue()
        latest: dict[str, RunStats] = {}  # the window's RunStats, which the engine keeps filling

        def stepped(stats: RunStats) -> None:
            latest["stats"] = stats

        def work() -> None:
            try:
                call(
                    *map(list, columns),
                    **kwargs,
                    **(named or {}),
                    use_tqdm=False,
                    on_output=lambda out, i: events.put(("row", (i, out))),
                    on_step=stepped,
                )
                events.put(("done", None))
            except BaseException as e:  # raised again in the generator, where Ray reports it
                events.put(("error", e))

        thread = threading.Thread(target=work, name="replica-generate", daemon=True)
        thread.start()
        last_sent = time.monotonic()
        finished = False
        while not finished:
            rows: list[tuple[int, RequestOutput | PoolingRequestOutput]] = []
            try:
                kind, payload = events.get(timeout=_STATS_EVERY_S)
            except queue.Empty:
                kind, payload = "tick", None
            while True:
                if kind == "error":
                    raise payload
                if kind == "row":
                    rows.append(payload)
                finished = finished or kind == "done"
                try:
                    kind, payload = events.get_nowait()
                except queue.Empty:
                    break
            if finished:
                thread.join()
                stats = self.llm.run_stats
                yield ReplicaUpdate(rows, stats.to_record(), True, list(stats.first_token_s))
            elif rows or time.monotonic() - last_sent >= _STATS_EVERY_S:
                stats = latest.get("stats")
                yield ReplicaUpdate(rows, stats.to_record() if stats else {})
                last_sent = time.monotonic()
