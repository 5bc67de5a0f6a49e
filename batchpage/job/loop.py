"""The batch job: a dataset in, completions.parquet and run.json out, resumable. No Hydra here.

    run_job(cfg)   per window: skip done rows, write bad rows at once, generate the rest, shard
    plan_job(cfg)  in plan.py; dry_run(cfg) in dry_run.py: the job's shape, loads no weights

Prompts: a plain `prompt` is sent as raw text (HumanEval-style completion prompts); `messages`
go through the model's chat template, and so does a plain prompt with a system_prompt (it becomes
a chat: [system, user]). Rows are submitted to the engine one window at a time, so rows in flight
are at most one window: that is what a kill -9 can cost, nothing more (see batchpage.output.writer).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from batchpage.data.spec import Row, iter_windows
from batchpage.job.config import JobConfig, to_plain
from batchpage.job.plan import JobConfigError, JobPlan, plan_job
from batchpage.metrics import RunStats, tokens_per_s
from batchpage.model.tokenizer import Tokenizer
from batchpage.output import (
    RUN_FILE,
    OutputDirError,
    ResultRow,
    ShardWriter,
    finalize,
    write_run_json,
)
from batchpage.outputs import RequestOutput
from batchpage.sampling_params import SamplingParams

log = logging.getLogger(__name__)

@dataclass
class JobResult:
    output_dir: Path
    rows: int
    rows_resumed: int
    rows_generated: int
    errors: int
    first_error: str | None
    metrics: dict[str, Any]


class Prepared(NamedTuple):
    row: Row
    prompt: str | list[int]  # raw text, or chat-template token ids
    text: str  # what the output's prompt column holds (the rendered chat for chats)
    params: SamplingParams


LLMFactory = Callable[..., Any]


# --- prompts and per-row parameters --------------------------------------------------------------


def row_seed(base_seed: int, index: int) -> int:
    """A row's own seed from the job seed and its input position: independent of windows, batch
    order and resume, and unrelated between neighbouring rows."""
    digest = hashlib.blake2b(f"{base_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: a valid torch seed


def prepare_window(
    rows: Iterable[Row], tokenizer: Tokenizer | None, base: SamplingParams, base_seed: int
) -> tuple[list[Prepared], list[ResultRow]]:
    """Rows -> (prompts to generate, rows that already failed with their error). The tokenizer
    renders chats; it may be None when every row has an error."""
    ready: list[Prepared] = []
    failed: list[ResultRow] = []
    for row in rows:
        if row.error is not None:
            failed.append(ResultRow.failed(row.index, row.id, row.error, row.prompt))
            continue
        try:
            params = base.replace(**row.overrides) if row.overrides else base
            if not params.is_greedy and "seed" not in row.overrides:
                params = params.replace(seed=row_seed(base_seed, row.index))
        except (ValueError, TypeError) as e:
            failed.append(
                ResultRow.failed(row.index, row.id, f"bad sampling value: {e}", row.prompt)
            )
            continue
        if row.messages is None and not row.system_prompt:
            ready.append(Prepared(row, row.prompt or "", row.prompt or "", params))
            continue
        assert tokenizer is not None, "a row to generate needs the tokenizer"
        try:
            ids = tokenizer.apply_chat_template(row.chat_messages() or [])
        except Exception as e:  # a template can fail on one odd chat; only that row fails
            failed.append(ResultRow.failed(row.index, row.id, f"chat template failed: {e}"))
            continue
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ready.append(Prepared(row, ids, text, params))
    return ready, failed


def to_result(p: Prepared, out: RequestOutput, n: int) -> ResultRow:
    if out.error is not None:
        return ResultRow(
            p.row.index, p.row.id, p.text, prompt_tokens=len(out.prompt_token_ids), error=out.error
        )
    texts = [o.text for o in out.outputs]
    reasons = [o.finish_reason or "length" for o in out.outputs]
    return ResultRow(
        index=p.row.index,
        id=p.row.id,
        prompt=p.text,
        completion=texts[0] if n == 1 else texts,
        finish_reason=reasons[0] if n == 1 else reasons,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=sum(len(o.token_ids) for o in out.outputs),
        cached_tokens=out.num_cached_tokens,
    )


# --- run -----------------------------------------------------------------------------------------


def run_job(cfg: JobConfig, llm_factory: LLMFactory | None = None) -> JobResult:
    """Run (or resume) the job into cfg.output_dir. llm_factory(model, **engine) makes the LLM;
    it is called only when a window has rows left to generate."""
    if not cfg.output_dir:
        raise JobConfigError("output_dir is not set: pass output_dir=<folder>")
    started = time.perf_counter()
    plan = plan_job(cfg)
    out = Path(cfg.output_dir)
    try:
        writer = ShardWriter(
            out,
            plan.fingerprint,
            plan.params.n,
            overwrite=cfg.overwrite,
            flush_rows=cfg.flush_rows,
            flush_seconds=cfg.flush_seconds,
        )
    except OutputDirError as e:
        raise JobConfigError(str(e)) from None
    llm: Any = None
    windows: list[RunStats] = []  # one per generate() call
    rows = resumed = generated = 0
    bar = tqdm(total=plan.info.num_rows, unit="row", desc="rows", disable=not cfg.progress)
    with writer, bar:
        if writer.num_done:
            log.info("resuming into %s: %d rows already done", out, writer.num_done)
        for window in iter_windows(cfg.dataset):
            rows += len(window)
            todo = [r for r in window if not writer.is_done(r.index)]
            resumed += len(window) - len(todo)
            bar.update(len(window) - len(todo))
            if llm is None and any(r.error is None for r in todo):
                bar.set_postfix_str("loading model", refresh=True)
                llm = _make_llm(cfg, llm_factory)
            # Without an LLM every row left has an error, and error rows need no tokenizer.
            tokenizer = llm.tokenizer if llm is not None else None
            ready, failed = prepare_window(todo, tokenizer, plan.params, plan.base_seed)
            writer.add_many(failed)  # written now: a bad row never waits for the window
            bar.update(len(failed))
            if ready:
                done_before = RunStats.merged(windows)
                progress = _Progress(bar, done_before, writer, ready, plan.params.n)
                llm.generate(
                    [p.prompt for p in ready],
                    [p.params for p in ready],
                    use_tqdm=False,
                    on_output=progress.saved,
                )
                windows.append(llm.run_stats)
                generated += len(ready)
    final = finalize(out, rows)
    metrics = {
        **RunStats.merged(windows).as_dict(),
        "wall_s": time.perf_counter() - started,
        "rows": rows,
        "rows_resumed": resumed,
        "rows_generated": generated,
        "rows_failed": final.errors,
    }
    # A rerun that found everything done keeps the run.json of the run that did the work.
    if generated or not (out / RUN_FILE).exists():
        write_run_json(out, _run_config(cfg, plan), metrics)
    first_error = _first_error(final.path) if final.errors else None
    return JobResult(out, rows, resumed, generated, final.errors, first_error, metrics)


class _Progress:
    """Saves a window's rows the moment each finishes (a kill loses rows in flight only) and
    keeps the bar's rate and hit rate live, over this window and the ones before it."""

    def __init__(
        self, bar: tqdm, before: RunStats, writer: ShardWriter, ready: list[Prepared], n: int
    ) -> None:
        self.bar, self.before, self.writer, self.ready, self.n = bar, before, writer, ready, n
        self.start = time.perf_counter()
        self.tokens = self.prompt = self.cached = 0

    def saved(self, out: RequestOutput, index: int) -> None:
        self.writer.add(to_result(self.ready[index], out, self.n))
        self.writer.maybe_flush()
        self.tokens += sum(len(c.token_ids) for c in out.outputs)
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens
        before = self.before
        elapsed = before.elapsed_s + time.perf_counter() - self.start
        tokens = before.generated_tokens + self.tokens
        prompt = before.prompt_tokens + self.prompt
        cached = before.cached_prompt_tokens + self.cached
        self.bar.update(1)
        self.bar.set_postfix(
            tok_s=f"{tokens_per_s(tokens, elapsed):.1f}",
            hit=f"{cached / max(prompt, 1):.0%}",
            refresh=False,
        )


def _make_llm(cfg: JobConfig, factory: LLMFactory | None) -> Any:
    if factory is None:
        from batchpage.llm import LLM  # imported here: a dry run or a finished job needs no engine

        factory = LLM
    try:
        return factory(cfg.model.path, **asdict(cfg.engine))
    except ValueError as e:  # checked in plan_job already; a model file can still be broken
        raise JobConfigError(str(e)) from None


def _run_config(cfg: JobConfig, plan: JobPlan) -> dict[str, Any]:
    return {
        "job": to_plain(cfg),
        "model": {
            "path": cfg.model.path,
            "kind": plan.source.kind,
            "file": str(plan.source.path),
            "identity": plan.fingerprint["model"],
            "max_model_len": plan.engine.max_model_len,
        },
        "dataset": {
            "files": list(plan.info.files),
            "format": plan.info.format,
            "preset": plan.info.preset,
            "num_rows": plan.info.num_rows,
            "fingerprint": plan.info.fingerprint,
        },
        "fingerprint": plan.fingerprint,
    }


def _first_error(path: Path) -> str | None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    errors = pq.read_table(path, columns=["error"]).column("error")
    found = pc.drop_null(errors)
    return found[0].as_py() if len(found) else None
