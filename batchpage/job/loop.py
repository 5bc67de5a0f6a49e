"""The batch job: a dataset in, completions.parquet and run.json out, resumable. No Hydra here.

    run_job(cfg)   per window: skip done rows, write bad rows at once, generate the rest, shard
    plan_job(cfg)  in plan.py; prompts in prompts.py; run.json and the summary in report.py

Rows are submitted to the engine one window at a time and saved the moment each finishes, so a
kill -9 costs the rows in flight and nothing more (see batchpage.output.writer). The output
folder (a local folder or a URL: every file goes through its Store) stays locked from the first
check to the last file written (scores, run.json). The output is committed once, after the last
output file: `_SUCCESS` (batchpage.output.manifest), then run.json.

Four things outside the job stop it part-way with JobStoppedError (exit 2, the rows saved so
far kept, a rerun resumes): a full disk, an input file that changed while it was read
(input_watch.py), another job that took the output folder over (a lease that expired), and a
store that still fails after its retries.
"""

from __future__ import annotations

import errno
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchpage.data.spec import iter_windows
from batchpage.host_memory import older_objects_frozen
from batchpage.job.capacity import window_rows
from batchpage.job.config import JobConfig
from batchpage.job.humaneval_scores import code_of, score_output
from batchpage.job.input_watch import InputWatch
from batchpage.job.job_estimate import JobEstimate, job_estimate
from batchpage.job.plan import JobConfigError, JobPlan, JobStoppedError, plan_job
from batchpage.job.pooled_columns import check_url, pool_result, pool_rows
from batchpage.job.progress import JobProgress, job_rate
from batchpage.job.progress_file import ProgressFile
from batchpage.job.prompts import Prepared, prepare_window, to_result
from batchpage.job.report import (
    JobResult,
    RunParts,
    ThisRun,
    resolved_settings,
    summarize,
    write_report,
)
from batchpage.job.row_images import image_order
from batchpage.metrics import RunStats
from batchpage.output import OutputDirError, ShardWriter, finalize
from batchpage.output.batch_files import write_batch_files
from batchpage.output.files import BATCH_ERRORS_FILE, BATCH_OUTPUT_FILE, FINAL_FILE, SCORES_FILE
from batchpage.output.manifest import commit
from batchpage.request_outputs import PoolingRequestOutput, RequestOutput
from batchpage.simulate.memory import peak_resident_bytes
from batchpage.storage import OutputLostError, StorageError

LLMFactory = Callable[..., Any]
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Seconds between progress.json's rewrites while rows finish and steps run.
PROGRESS_EVERY_S = 10.0


def run_job(cfg: JobConfig, llm_factory: LLMFactory | None = None) -> JobResult:
    """Run (or resume) the job into cfg.output_dir. llm_factory(model, **engine) makes the LLM;
    it is called only when a window has rows left to generate."""
    if not cfg.output_dir:
        raise JobConfigError("output_dir is not set: pass output_dir=<folder>")
    started_wall, started = time.time(), time.perf_counter()
    if llm_factory is None:
        llm_factory = _executor_factory(cfg)
    plan = plan_job(cfg)
    out = cfg.output_dir
    try:
        writer = ShardWriter(
            out,
            plan.fingerprint,
            plan.params.n,
            overwrite=cfg.overwrite,
            flush_rows=cfg.flush_rows,
            flush_seconds=cfg.flush_seconds,
            extra_schema=plan.extra_schema,
            listed=plan.listed,
            store=plan.stores.store_for(out),
            lease_seconds=cfg.storage.lease_seconds,
        )
    except OutputDirError as e:
        raise JobConfigError(str(e)) from None
    except OSError as e:  # a file, or a folder this user cannot write
        raise JobConfigError(f"output_dir {out} cannot be used: {e.strerror or e}") from None
    watch = InputWatch(plan.info.files, plan.info.fingerprint["files"], out, plan.stores)
    try:
        with writer:
            return _run(cfg, plan, llm_factory, writer, watch, (started_wall, started))
    except OutputLostError as e:
        raise JobStoppedError(
            f"{e} ({writer.num_saved} rows this job saved in {out} are kept: rerun with the "
            "same output_dir to resume once the folder is free)"
        ) from None
    except StorageError as e:  # past its retries: the store's own message names the URL
        raise JobStoppedError(
            f"{e}; the job stopped with {writer.num_saved} rows saved in {out}: rerun the same "
            "command to resume (rows not saved are generated again)"
        ) from None
    except OSError as e:
        if e.errno not in _DISK_FULL:
            raise
        raise JobStoppedError(
            f"no space left on the device of {out} ({e.filename or e.strerror or e}): "
            f"{writer.num_saved} rows are saved there; free some space (or move the folder "
            "elsewhere) and rerun with the same output_dir to resume"
        ) from None


def _run(
    cfg: JobConfig,
    plan: JobPlan,
    llm_factory: LLMFactory | None,
    writer: ShardWriter,
    watch: InputWatch,
    started: tuple[float, float],
) -> JobResult:
    """The job's body, under the writer's lock: windows, the final merge, scores, the commit
    point (_SUCCESS), run.json."""
    out, store = writer.output_dir, writer.store
    # The windows' figures merged as each ends (not kept one by one: a job has windows by the
    # thousand, each with a figure per row).
    generated_stats = RunStats.merged([])
    rows = resumed = generated = 0
    by_adapter: Counter[str] = Counter()  # rows generated per adapter (dataset.lora_column)
    llm: Any = None
    progress = JobProgress(plan.info.num_rows, cfg.progress)
    status = ProgressFile(out, progress, store=store, every_s=PROGRESS_EVERY_S)
    estimate, no_estimate = job_estimate(cfg, plan, writer.num_done)
    if estimate is not None:
        progress.eta_model = estimate.eta_s
    clock = time.perf_counter
    parts = RunParts(setup=clock() - started[1])
    frozen = ExitStack()  # from the model's load to the last window (host_memory.py)
    try:
        if writer.num_done:
            progress.note(f"resuming into {out}: {writer.num_done} rows already done")
        mark = clock()  # reading the next window starts
        for window in iter_windows(cfg.dataset, plan.info, plan.stores):
            away = 0.0  # of this window's seconds: the model's load and the generate call
            # Read before the check: if the file changed, this window may hold new rows.
            watch.check()
            rows += len(window)
            todo = [r for r in window if not writer.is_done(r.index)]
            if plan.openai_batch:
                todo = [check_url(r, plan.engine.task) for r in todo]
            resumed += len(window) - len(todo)
            progress.rows_skipped(len(window) - len(todo))
            if llm is None and any(r.error is None for r in todo):
                loading = clock()
                llm = _load_llm(cfg, llm_factory, progress)
                parts.load = away = clock() - loading
                # The model, the engine and the imports stay out of the collector's walks
                # while the windows' rows come and go.
                frozen.enter_context(older_objects_frozen())
                status.executor = _executor_figures(llm)
                progress.replicas = getattr(llm, "replica_line", None)
            # Without an LLM every row left has an error, and error rows need no tokenizer.
            tokenizer = llm.tokenizer if llm is not None else None
            ready, failed = prepare_window(
                todo, tokenizer, plan.params, plan.base_seed, plan.prompts, plan.adapters
            )
            writer.add_many(failed)  # written now: a bad row never waits for the window
            progress.rows_skipped(len(failed), failed=True)
            if estimate is not None:
                estimate.rows_read(len(window), len(window) - len(todo))
            if ready:
                if estimate is not None:
                    estimate.window(window_rows(ready, plan.engine.task))
                calling = clock()
                generated_stats.absorb(
                    _generate(llm, plan, ready, writer, progress, generated_stats, status, estimate)
                )
                spent = clock() - calling
                parts.generate += spent
                away += spent
                if estimate is not None:
                    estimate.window_done()
                generated += len(ready)
                by_adapter.update(p.lora.lora_name if p.lora else "base" for p in ready)
            del ready  # with its rows' decoded images: not kept while the next window is read
            status.write()
            now = clock()
            parts.io += now - mark - away
            if estimate is not None:
                estimate.outside(now - mark - away)
            mark = now
        watch.check()  # a file cut short ends the reading early: the row count tells nothing
        watch.check_digests()
    except (OSError, ValueError, pa.ArrowException):
        watch.check()  # a reader tripped on a file changing under it: say that instead
        raise
    finally:
        frozen.close()
        progress.close()
        if hasattr(llm, "close"):  # an executor's replicas
            llm.close()
    writer.flush()
    try:
        status.write(stage="done", wait=True)
    finally:
        status.close()
    final = finalize(out, rows, store=store, commit_now=False)
    written = [(FINAL_FILE, final.rows)]
    if plan.openai_batch:
        answered, failed = write_batch_files(out, Path(cfg.model.path).name, store=store)
        written += [(BATCH_OUTPUT_FILE, answered), (BATCH_ERRORS_FILE, failed)]
    score = score_output(out, cfg.score, store=store) if cfg.score else None
    if score is not None:
        written.append((SCORES_FILE, score["samples"]))
    writer.check()  # still this job's folder: then commit, last of the output files
    commit(store, out, written, final.shards, writer.fingerprint)
    wall_s = time.perf_counter() - started[1]
    parts.finish = wall_s - parts.setup - parts.load - parts.io - parts.generate
    report = estimate.report(parts.setup) if estimate is not None else None
    if estimate is not None and estimate.failed is not None:
        no_estimate = estimate.failed
    run = ThisRun(
        started[0], wall_s, generated, resumed,
        generated_stats, dict(by_adapter) if plan.adapters else {}, parts, report, no_estimate,
        peak_resident_bytes(),
    )  # fmt: skip
    metrics = write_report(store, out, cfg, plan, _settings(plan, llm), run, rows, score)
    reasons, samples, first_error = summarize(store, final.path)
    return JobResult(
        out,
        rows,
        resumed,
        generated,
        final.errors,
        first_error or None,
        metrics,
        plan.engine.task,
        reasons,
        samples,
        score,
        this_run=run.figures(),
        completions=final.path,
    )


def _generate(
    llm: Any,
    plan: JobPlan,
    ready: list[Prepared],
    writer: ShardWriter,
    progress: JobProgress,
    before: RunStats,
    status: ProgressFile,
    estimate: JobEstimate | None = None,
) -> RunStats:
    """One window through the engine; each row is saved the moment it finishes (and told to
    the job's estimate, with each step). `before`: the job's windows so far, merged. Rows with
    images go with them, those of the same images together (row_images.image_order)."""
    max_len = plan.engine.max_model_len
    ready = image_order(ready)

    def budget(p: Prepared) -> int:
        room = max_len - len(p.prompt_ids)
        return p.params.n * min(p.params.max_tokens or room, room)

    progress.window_started([len(p.prompt_ids) + budget(p) for p in ready])

    def saved(out: RequestOutput, index: int) -> None:
        p = ready[index]
        result = to_result(p, out, plan.listed, llm.tokenizer if plan.openai_batch else None)
        if plan.reasoning is not None and out.error is None:
            thoughts = [c.reasoning for c in out.outputs]
            result.extra["reasoning"] = thoughts if plan.listed else thoughts[0]
        if plan.style is not None and out.error is None:
            codes = [code_of(plan.style, p.row.prompt, c.text) for c in out.outputs]
            result.extra["code"] = codes if plan.listed else codes[0]
        writer.add(result)
        writer.maybe_flush()
        if plan.adapters is not None:
            status.rows_by_adapter[p.lora.lora_name if p.lora else "base"] += 1
        used = sum(len(c.token_ids) for c in out.outputs)
        if estimate is not None and out.error is None:
            estimate.finished([len(c.token_ids) for c in out.outputs])
        unused = max(0, budget(p) - used) if out.error is None else 0
        progress.row_finished(unused_budget=unused, failed=out.error is not None)
        status.maybe_write()

    def stepped(stats: RunStats) -> None:
        if estimate is not None:
            estimate.step(stats)
        progress.step(stats, job_rate(before, stats))
        status.maybe_write()

    task = plan.engine.task
    if task != "generate":

        def pooled(p: Prepared, outs: list[PoolingRequestOutput]) -> None:
            labels = llm.model_config.head.labels
            writer.add(pool_result(p, outs, task, labels, plan.listed))
            writer.maybe_flush()
            progress.row_finished(unused_budget=budget(p), failed=any(o.error for o in outs))
            status.maybe_write()

        pool_rows(llm, task, ready, plan.pooling, pooled, stepped)
        return llm.run_stats
    loras = [p.lora for p in ready]
    llm.generate(
        [p.engine_prompt for p in ready],
        [p.params for p in ready],
        use_tqdm=False,
        on_output=saved,
        on_step=stepped,
        **({"lora_request": loras} if any(loras) else {}),
    )
    return llm.run_stats


def _load_llm(cfg: JobConfig, factory: LLMFactory | None, progress: JobProgress) -> Any:
    progress.stage("loading model")
    progress.note(f"loading {cfg.model.path} ...")
    start = time.perf_counter()
    if factory is None:
        from batchpage.llm import LLM  # imported here: a dry run or a finished job needs no engine

        factory = LLM
    try:
        llm = factory(cfg.model.path, **_engine_options(cfg))
    except ValueError as e:  # checked in plan_job already; a model file can still be broken
        raise JobConfigError(str(e)) from None
    plan = llm.plan
    progress.note(
        f"model ready in {time.perf_counter() - start:.1f} s: {plan.device}, "
        f"{str(plan.dtype).removeprefix('torch.')}, "
        f"attention {_attention_name(llm)}, "
        f"{plan.num_blocks} KV blocks"
    )
    return llm


def _engine_options(cfg: JobConfig) -> dict[str, Any]:
    """The LLM's arguments: engine.*, its image bound raised to the dataset's, so that the
    images the job decoded within dataset.max_image_pixels are taken as they are."""
    options = asdict(cfg.engine)
    pixels = max(cfg.engine.max_image_pixels, cfg.dataset.max_image_pixels)
    return {**options, "max_image_pixels": pixels}


def _executor_factory(cfg: JobConfig) -> LLMFactory | None:
    """None for executor=local; for executor=ray a factory of engine replicas (Ray checked now,
    before anything loads)."""
    from batchpage.executor import executor_factory

    try:
        return executor_factory(cfg.executor)
    except ValueError as e:
        raise JobConfigError(str(e)) from None


def _attention_name(llm: Any) -> str:
    name = getattr(llm, "attention_name", None)  # an executor's replicas report theirs
    return name or type(llm.engine.runner.attention).__name__


def _executor_figures(llm: Any) -> Callable[[], dict[str, Any]] | None:
    """An executor's figures now (its replicas' rows and rates, lost and replaced) for
    progress.json; None for the local engine."""
    describe = getattr(llm, "describe", None)
    return None if describe is None else lambda: describe()["executor"]


def _settings(plan: JobPlan, llm: Any) -> dict[str, Any]:
    """What `auto` resolved to, and where the job generated (describe(): an executor's own)."""
    describe = getattr(llm, "describe", None)
    if describe is None:
        return {**resolved_settings(plan, llm), "executor": {"kind": "local"}}
    return {**resolved_settings(plan, None), **describe()}
