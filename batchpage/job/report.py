"""What a job tells afterwards: run.json (config, the settings that were resolved, one entry per
run into the output_dir and the totals over them) and the summary the command line prints."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow.parquet as pq

from batchpage.job.config import JobConfig, to_plain
from batchpage.job.plan import JobPlan
from batchpage.metrics import RunStats
from batchpage.output import RUN_FILE, write_run_json
from batchpage.output.files import PROGRESS_FILE
from batchpage.simulate.capacity import estimate_error
from batchpage.storage import Store, safe_url

# Rows of completions.parquet the summary holds as Python objects at once.
SUMMARY_BATCH_ROWS = 8192


@dataclass
class JobResult:
    output_dir: str  # a local folder or a URL ("s3://bucket/run-42", no trailing slash)
    rows: int
    rows_resumed: int
    rows_generated: int
    errors: int
    first_error: str | None
    metrics: dict[str, Any]  # totals over every run into output_dir, as in run.json
    task: str = "generate"  # the engine's task as resolved: generate, or a pooling task
    finish_reasons: dict[str, int] = field(default_factory=dict)  # generation rows without error
    samples: list[dict[str, Any]] = field(default_factory=list)  # a few finished rows
    score: dict[str, Any] | None = None  # with cfg.score: the scorer's summary
    # This invocation's own figures (ThisRun.figures): what the summary says this run did. The
    # totals above include earlier runs, whose rates a resumed run must not repeat as its own.
    this_run: dict[str, Any] = field(default_factory=dict)
    completions: str = ""  # the path (or URL) of completions.parquet


@dataclass
class RunParts:
    """Where a run's wall time went, measured (run.json's runs[].parts_s)."""

    setup: float = 0.0  # planning and opening the output, up to the first window
    load: float = 0.0  # the model's
    io: float = 0.0  # reading and tokenizing the rows, writing bad ones, estimating windows
    generate: float = 0.0  # the windows' generate calls, their rows saved as they finish
    finish: float = 0.0  # the rest: the last shard, completions.parquet, scores, the commit


@dataclass(frozen=True)
class ThisRun:
    """One invocation of the job, for run.json's history."""

    started: float  # time.time()
    wall_s: float
    rows_generated: int
    rows_resumed: int
    stats: RunStats
    rows_by_adapter: dict[str, int] = field(default_factory=dict)  # with dataset.lora_column
    parts: RunParts = field(default_factory=RunParts)
    # This machine's estimate of the run (job_estimate.JobEstimate.report); None: none, and why.
    estimate: dict[str, Any] | None = None
    no_estimate: str | None = None
    # The job process's peak resident bytes at its end (simulate/memory.peak_resident_bytes).
    peak_rss_bytes: int | None = None

    def figures(self) -> dict[str, Any]:
        """Its metrics (the names of run.json's) with its wall time; zeros when it generated
        nothing (every row resumed)."""
        return {**self.stats.as_dict(), "wall_s": self.wall_s}


def resolved_settings(plan: JobPlan, llm: Any | None) -> dict[str, Any]:
    """What "auto" became: device, dtype, attention backend, threads, pool size."""
    import torch

    settings: dict[str, Any] = {
        "device": str(plan.engine.device),
        "dtype": str(plan.engine.dtype).removeprefix("torch."),
        "max_model_len": plan.engine.max_model_len,
        "kv_blocks": plan.engine.num_blocks,
        "kv_cache_bytes": plan.engine.kv_cache_bytes,
        "threads": torch.get_num_threads(),
        # How its OpenMP threads wait (omp_wait.py: PASSIVE when the machine was busy at start).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "style": plan.style,
    }
    if llm is not None:
        settings["attention_backend"] = type(llm.engine.runner.attention).__name__
    return settings


def write_report(
    store: Store,
    out: str,
    cfg: JobConfig,
    plan: JobPlan,
    settings: dict[str, Any],
    run: ThisRun,
    rows: int,
    score: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Append this run to run.json's history (a run that generated nothing adds no entry) and
    rewrite the totals. Returns the totals."""
    runs = _previous_runs(store, out)
    if run.rows_generated or not runs:
        runs.append(
            {
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.started)),
                "wall_s": run.wall_s,
                "rows_generated": run.rows_generated,
                "rows_resumed": run.rows_resumed,
                "parts_s": asdict(run.parts),
                "peak_rss_bytes": run.peak_rss_bytes,
                **_estimate_fields(run),
                "settings": settings,
                "stats": run.stats.to_record(),
                "metrics": run.stats.as_dict(),
                **({"rows_by_adapter": run.rows_by_adapter} if run.rows_by_adapter else {}),
            }
        )
    block_size = cfg.engine.block_size
    merged = RunStats.merged([RunStats.from_record(r["stats"], block_size) for r in runs])
    totals = merged.as_dict()
    # Time to first token is measured from each run's own start: it is reported per run only.
    del totals["ttft_s"]
    totals |= {
        "wall_s": sum(r["wall_s"] for r in runs),
        "runs": len(runs),
        "rows": rows,
        "rows_generated": sum(r["rows_generated"] for r in runs),
    }
    by_adapter: Counter[str] = Counter()
    for r in runs:
        by_adapter.update(r.get("rows_by_adapter", {}))
    if by_adapter:
        totals["rows_by_adapter"] = dict(sorted(by_adapter.items()))
    if score is not None:  # what scores.parquet holds; how many this run checked is its summary's
        totals["score"] = {k: v for k, v in score.items() if k not in ("checked", "reused")}
    config = {
        "job": to_plain(cfg),
        "resolved": runs[-1]["settings"],  # of the last run that generated
        "model": {
            "path": cfg.model.path,
            "kind": plan.source.kind,
            "file": str(plan.source.path),
            "identity": plan.fingerprint["model"],
        },
        "dataset": {
            "files": [safe_url(f) for f in plan.info.files],
            "format": plan.info.format,
            "preset": plan.info.preset,
            "num_rows": plan.info.num_rows,
        },
        "fingerprint": plan.fingerprint,
        "progress_file": PROGRESS_FILE,  # rewritten while the job ran: its last state
    }
    write_run_json(out, config, totals, runs=runs, store=store)
    return totals


def _estimate_fields(run: ThisRun) -> dict[str, Any]:
    """A run entry's `estimate` and `estimate_error` (its wall_s over the run's, less 1), or
    `estimate` None and `no_estimate`, why."""
    if run.estimate is None:
        return {"estimate": None, "no_estimate": run.no_estimate}
    return {"estimate": run.estimate, "estimate_error": estimate_error(run.estimate, run.wall_s)}


def _previous_runs(store: Store, out: str) -> list[dict[str, Any]]:
    # A missing or damaged run.json starts the history again; a store that fails raises.
    try:
        data = json.loads(store.read_bytes(store.join(out, RUN_FILE)))
    except (FileNotFoundError, ValueError):
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return runs if isinstance(runs, list) and all("stats" in r for r in runs) else []


def summarize(
    store: Store, path: str, n_samples: int = 2
) -> tuple[dict[str, int], list[dict[str, Any]], str]:
    """The finish reasons of the rows without an error, counted (none for a pooling job's rows),
    a few finished rows and the first error of completions.parquet. Read a batch of rows at a
    time: the file has a row per input row."""
    reasons: Counter[str] = Counter()
    samples: list[dict[str, Any]] = []
    first_error = ""
    columns = ["id", "completion", "finish_reason", "error"]
    with store.open_read(path) as f:
        for batch in pq.ParquetFile(f).iter_batches(SUMMARY_BATCH_ROWS, columns=columns):
            for rec in batch.to_pylist():
                if rec["error"] is not None:
                    first_error = first_error or rec["error"]
                    continue
                found = rec["finish_reason"]
                reasons.update(r for r in (found if isinstance(found, list) else [found]) if r)
                if len(samples) < n_samples and rec["completion"]:
                    samples.append({"id": rec["id"], "completion": rec["completion"]})
    return dict(reasons), samples, first_error
