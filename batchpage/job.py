"""The batch job: a dataset in, completions.parquet and run.json out, resumable. No Hydra here.

    plan_job(cfg)  everything that can be wrong with the config, checked before the model loads
    run_job(cfg)   per window: skip done rows, write bad rows at once, generate the rest, shard
    dry_run(cfg)   in job_dry_run.py: the job's shape, loads no weights

Prompts: a plain `prompt` is sent as raw text (HumanEval-style completion prompts); `messages`
go through the model's chat template, and so does a plain prompt with a system_prompt (it becomes
a chat: [system, user]). Rows are submitted to the engine one window at a time, so rows in flight
are at most one window: that is what a kill -9 can cost, nothing more (see batchpage.output).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from batchpage.config import EngineConfig
from batchpage.data import DatasetInfo, Row, iter_windows, validate
from batchpage.engine.engine import plan_num_blocks
from batchpage.job_config import JobConfig, to_plain
from batchpage.model.loader import ModelSource, resolve_dtype, resolve_model_source
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

# Bump when the way prompts are built changes: old output_dirs then refuse to resume into a mix.
PROMPT_FORMAT = 1
# Counts that add up over windows; the rest of llm.stats is recomputed in StatsTotal.
_SUMMED = (
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "prefill_tokens_computed",
    "cached_prompt_tokens",
    "preemptions",
    "steps",
)


class JobConfigError(ValueError):
    """The job cannot start (bad path, column, model, pool size, output_dir). The message says
    how to fix it; nothing was generated."""


@dataclass(frozen=True)
class JobPlan:
    info: DatasetInfo
    source: ModelSource
    params: SamplingParams
    base_seed: int
    max_model_len: int
    pool_blocks: int
    fingerprint: dict[str, Any]


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


# --- plan: every check that needs no weights ---------------------------------------------------


def plan_job(cfg: JobConfig) -> JobPlan:
    """Validate dataset, sampling, model and KV pool; raise JobConfigError with the fix."""
    try:
        info = validate(cfg.dataset)
        params = cfg.sampling.to_params()
        source = resolve_model_source(cfg.model.path)
        engine = EngineConfig(**asdict(cfg.engine))  # validated again: cfg may be hand-built
        device = engine.resolved_device()
        limit = source.config.max_position_embeddings
        if engine.max_model_len is not None and engine.max_model_len > limit:
            raise ValueError(
                f"engine.max_model_len={engine.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}: lower engine.max_model_len"
            )
        max_model_len = engine.max_model_len or limit
        dtype = resolve_dtype(engine.dtype, source.config, device)
        pool_blocks = plan_num_blocks(engine, source.config, max_model_len, dtype, device)
    except (ValueError, OSError) as e:
        raise JobConfigError(str(e)) from None
    base_seed = cfg.sampling.seed if cfg.sampling.seed is not None else engine.seed
    # What the results depend on; engine knobs such as block_size only change the speed, and
    # engine.seed matters only to random sampling without a sampling.seed.
    engine_seed = engine.seed if cfg.sampling.seed is None and not params.is_greedy else None
    fingerprint = {
        # The files, not the path: the same model named another way resumes, while a
        # checkpoint replaced at the same path is another job.
        "model": model_identity(source),
        "sampling": asdict(cfg.sampling),
        "engine_seed": engine_seed,
        "dataset": info.fingerprint,
        "max_model_len": max_model_len,
        "prompt_format": PROMPT_FORMAT,
    }
    return JobPlan(info, source, params, base_seed, max_model_len, pool_blocks, fingerprint)


def model_identity(source: ModelSource) -> list[Any]:
    """Name, size and a hash of the first/last 64 KiB of each weight file: cheap (no gigabytes
    read) and enough to tell checkpoints apart."""
    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))
    digests = []
    for path in files:
        size = path.stat().st_size
        h = hashlib.sha256()
        with open(path, "rb") as f:
            h.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read())
        digests.append([path.name, size, h.hexdigest()[:16]])
    return digests


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


# --- metrics over windows ------------------------------------------------------------------------


@dataclass
class StatsTotal:
    """llm.stats of each window, combined: counts add up, rates are recomputed over the whole
    run, kv_utilization is weighted by steps and ttft by requests (each window's ttft is measured
    from that window's start)."""

    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SUMMED, 0))
    generate_s: float = 0.0
    peak_running: int = 0
    kv_blocks_total: int = 0
    util_steps: float = 0.0
    ttft_weighted: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def add(self, stats: dict[str, Any]) -> None:
        for key in _SUMMED:
            self.sums[key] += int(stats.get(key, 0))
        self.generate_s += float(stats.get("elapsed_s", 0.0))
        self.peak_running = max(self.peak_running, int(stats.get("peak_running", 0)))
        self.kv_blocks_total = max(self.kv_blocks_total, int(stats.get("kv_blocks_total", 0)))
        self.util_steps += float(stats.get("kv_utilization", 0.0)) * int(stats.get("steps", 0))
        ttft, weight = stats.get("ttft_s") or {}, int(stats.get("requests", 0))
        self.ttft_weighted[0] += float(ttft.get("p50", 0.0)) * weight
        self.ttft_weighted[1] += float(ttft.get("p90", 0.0)) * weight

    @property
    def tokens_per_s(self) -> float:
        return self.sums["generated_tokens"] / self.generate_s if self.generate_s else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        s = self.sums
        return s["cached_prompt_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0

    def as_dict(self, elapsed_s: float) -> dict[str, Any]:
        s, wall = self.sums, max(elapsed_s, 1e-9)
        util = self.util_steps / s["steps"] if s["steps"] else 0.0
        reqs = s["requests"]
        return {
            "elapsed_s": elapsed_s,
            "generate_s": self.generate_s,
            **s,
            "output_tokens_per_s": s["generated_tokens"] / wall,
            "total_tokens_per_s": (s["prompt_tokens"] + s["generated_tokens"]) / wall,
            "prefix_hit_rate": self.prefix_hit_rate,
            "peak_running": self.peak_running,
            "kv_blocks_total": self.kv_blocks_total,
            "kv_utilization": util,
            "kv_waste": 1.0 - util if s["steps"] else 0.0,
            "ttft_s": {
                "p50": self.ttft_weighted[0] / reqs if reqs else 0.0,
                "p90": self.ttft_weighted[1] / reqs if reqs else 0.0,
            },
        }


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
    total = StatsTotal()
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
                progress = _Progress(bar, total, writer, ready, plan.params.n)
                llm.generate(
                    [p.prompt for p in ready],
                    [p.params for p in ready],
                    use_tqdm=False,
                    on_output=progress.saved,
                )
                total.add(llm.stats)
                generated += len(ready)
    final = finalize(out, rows)
    metrics = {
        **total.as_dict(time.perf_counter() - started),
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
    keeps the bar's rate and hit rate live."""

    def __init__(
        self, bar: tqdm, total: StatsTotal, writer: ShardWriter, ready: list[Prepared], n: int
    ) -> None:
        self.bar, self.total, self.writer, self.ready, self.n = bar, total, writer, ready, n
        self.start = time.perf_counter()
        self.tokens = self.prompt = self.cached = 0

    def saved(self, out: RequestOutput, index: int) -> None:
        self.writer.add(to_result(self.ready[index], out, self.n))
        self.writer.maybe_flush()
        self.tokens += sum(len(c.token_ids) for c in out.outputs)
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens
        sums = self.total.sums
        elapsed = self.total.generate_s + time.perf_counter() - self.start
        tokens = sums["generated_tokens"] + self.tokens
        prompt = sums["prompt_tokens"] + self.prompt
        cached = sums["cached_prompt_tokens"] + self.cached
        self.bar.update(1)
        self.bar.set_postfix(
            tok_s=f"{tokens / max(elapsed, 1e-9):.1f}",
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
            "max_model_len": plan.max_model_len,
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
