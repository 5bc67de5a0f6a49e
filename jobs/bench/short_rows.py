"""Short rows through the engine and through the job (#74 item 2): the same prompts, rows/s.

    python -m jobs.bench.short_rows                   # 20,000 rows, a few minutes
    python -m jobs.bench.short_rows --rows 100000     # the issue's figure (quiet machine only)
    python -m jobs.bench.short_rows --profile         # also py-spy's profile of the job

One-line prompts of `--tokens` (16-40) tokens each (words that are one token each in the tiny
random model's tokenizer, so a row's length is its word count), one carried column, as JSON
lines; `--max-tokens` (4) out each, greedy, ignore_eos; the tiny random model
(jobs/bench/random_models.py), the engine's default settings in both halves (max_num_seqs etc.).
- engine: `LLM.generate` over the prompts' token ids (tokenized as the job tokenizes them, in
  the tokenizer's one batch call; that time is reported apart), in calls of `--window` prompts
  (the job's windows) and then all at once, each on a fresh engine after a warm-up; rows/s of
  the generate calls. The ratios are to the all-at-once rate.
- job: `python -m batchpage.run dataset.path=... model.path=... sampling.max_tokens=4 ...` in a
  subprocess, as a user runs it (its progress bar on, into job.log), fresh output folder;
  rows/s of the command's wall time, of run.json's `wall_s` (plan, load, windows, commit) and
  of its `generate` part; run.json's other parts beside them.
  With --profile, py-spy records the job (a second run, not the timed one) into the workdir.
- overhead (--what overhead): the job in this process with an engine that answers at once
  (each prompt gets `--max-tokens` fixed tokens; a step reported every ROWS_PER_STEP rows):
  what the job's own per-row work costs (reading, prompts, tokenizing, results, shards,
  progress, the final merge), in µs a row, with run.json's parts; the model still loads.
Each result is printed as a markdown row as it comes (a long run's partial results survive;
--out rewrites its JSON after each), with the CPU, its flags and the load average (1 minute) at
each row. The job's completions are
checked against the engine's (same text for each row).
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.bench.random_models import random_model_folder
from jobs.bench.report import command_line, environment, ints, log, machine, parser, write_json

ROOT = Path(__file__).resolve().parents[2]
LABELS = ("positive", "negative", "neutral")  # the carried column's values
# Rows a step finishes in the overhead run: about what one step of this workload prefills (the
# CPU default of 512 batched tokens over prompts of 28 tokens on average).
ROWS_PER_STEP = 18


def one_token_words(tokenizer: Any) -> list[str]:
    """Alphabetic words that the tokenizer encodes as one token after a space: a prompt of k of
    them (the first one too, it is preceded by a space) is k tokens."""
    words = []
    for token in tokenizer.get_vocab():
        word = tokenizer.convert_tokens_to_string([token])
        if word.startswith(" ") and word[1:].isalpha() and len(word) > 3:
            words.append(word[1:])
    words.sort()
    ids = tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]
    return [w for w, one in zip(words, ids, strict=True) if len(one) == 1]


def write_short_prompts(
    path: Path, tokenizer: Any, rows: int, tokens: tuple[int, int], seed: int = 0
) -> Path:
    """`rows` JSON lines {id, prompt, label}: each prompt a line of tokens[0]..tokens[1] words
    from one_token_words."""
    rng = random.Random(seed)
    words = one_token_words(tokenizer)
    lo, hi = tokens
    with open(path, "w") as f:
        for i in range(rows):
            prompt = " " + " ".join(rng.choices(words, k=rng.randint(lo, hi)))
            line = {"id": f"r{i}", "prompt": prompt, "label": LABELS[i % len(LABELS)]}
            f.write(json.dumps(line) + "\n")
    return path


def read_prompts(path: Path) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f]


@dataclass(frozen=True)
class EngineRun:
    rows: int
    window: int | None  # prompts per generate call; None: all at once
    tokenize_s: float
    generate_s: float
    prompt_tokens: tuple[int, int, float]  # min, max, mean
    texts: list[str]

    @property
    def rows_s(self) -> float:
        return self.rows / self.generate_s


def run_engine(model: Path, prompts: list[str], max_tokens: int, window: int | None) -> EngineRun:
    """A fresh engine (the job's settings: LLM's defaults) on every prompt at once, or in
    generate calls of `window` prompts each (the job's windows, without the job)."""
    from batchpage import SamplingParams
    from jobs.bench.engine_runs import load_llm

    llm = load_llm(str(model), "engine")
    start = time.perf_counter()
    ids = llm.tokenizer.encode_batch(prompts)
    tokenize_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    step = window or len(ids)
    start = time.perf_counter()
    outs = [o for i in range(0, len(ids), step)
            for o in llm.generate(ids[i : i + step], params, use_tqdm=False)]  # fmt: skip
    generate_s = time.perf_counter() - start
    failed = [i for i, o in enumerate(outs) if o.error or not o.outputs]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {outs[failed[0]].error}")
    lengths = [len(x) for x in ids]
    texts = [o.outputs[0].text for o in outs]
    del llm, outs
    gc.collect()
    return EngineRun(
        len(prompts), window, tokenize_s, generate_s,
        (min(lengths), max(lengths), sum(lengths) / len(lengths)), texts,
    )  # fmt: skip


@dataclass(frozen=True)
class JobRun:
    code: int
    command_s: float
    run: dict[str, Any]  # run.json's last runs[] entry ({} when there is none)
    out: Path

    def rows_s(self, rows: int, seconds: float | None) -> float | None:
        return rows / seconds if seconds else None


def job_command(model: Path, data: Path, out: Path, max_tokens: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "batchpage.run", f"dataset.path={data}", f"model.path={model}",
        f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true",
        f"output_dir={out}", f"hydra.run.dir={out.parent}", *extra,
    ]  # fmt: skip


def run_job(
    cmd: list[str],
    out: Path,
    log_path: Path,
    prefix: Sequence[str] = (),
    threads: int | None = None,
) -> JobRun:
    """The job's command (behind `prefix`: py-spy) into a fresh `out`; `threads`: torch's
    (OMP_NUM_THREADS), None: its default."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with open(log_path, "w") as err:
        code = subprocess.call([*prefix, *cmd], cwd=ROOT, env=env, stdout=err, stderr=err)
    command_s = time.perf_counter() - start
    try:
        run = json.loads((out / "run.json").read_text())["runs"][-1]
    except (OSError, KeyError, IndexError, ValueError):
        run = {}
    return JobRun(code, command_s, run, out)


def same_completions(out: Path, texts: list[str]) -> tuple[int, int]:
    """(rows whose completion equals the engine's, rows) of the job's completions.parquet."""
    import pyarrow.parquet as pq

    table = pq.read_table(out / "completions.parquet", columns=["index", "completion"])
    index = table.column("index").to_pylist()
    completion = table.column("completion").to_pylist()
    same = sum(texts[i] == c for i, c in zip(index, completion, strict=True))
    return same, len(index)


def instant_engine(max_tokens: int) -> Any:
    """An LLM factory whose generate answers every prompt at once with `max_tokens` fixed
    tokens (the real model loads: its tokenizer and settings are the job's)."""
    from batchpage import LLM
    from batchpage.metrics import RunStats
    from batchpage.request_outputs import CompletionOutput, RequestOutput

    def factory(model: str, **engine: Any) -> Any:
        llm = LLM(model, **engine)
        ids = list(range(3, 3 + max_tokens))
        text = llm.tokenizer.decode(ids)

        def generate(prompts: list, params: Any = None, **kwargs: Any) -> list:
            stats = RunStats(kv_blocks_total=llm.plan.num_blocks, block_size=16)
            on_output, on_step = kwargs.get("on_output"), kwargs.get("on_step")
            outs = []
            for i, prompt in enumerate(prompts):
                one = CompletionOutput(0, text, list(ids), "length")
                outs.append(RequestOutput(str(i), None, prompt, [one]))
                stats.prefill_tokens_computed += len(prompt)
                stats.generated_tokens += max_tokens
                if on_output is not None:
                    on_output(outs[-1], i)
                if on_step is not None and i % ROWS_PER_STEP == ROWS_PER_STEP - 1:
                    on_step(stats)
            llm.run_stats = stats
            return outs

        llm.generate = generate
        return llm

    return factory


def job_overhead(
    model: Path, data: Path, out: Path, max_tokens: int, extra: list[str]
) -> tuple[str, dict[str, Any]]:
    """The job in this process on instant_engine: a markdown row of its own cost a row, and
    its figures."""
    from batchpage.job import run_job as run_the_job
    from batchpage.run import compose_job

    shutil.rmtree(out, ignore_errors=True)
    overrides = job_command(model, data, out, max_tokens, extra)[3:-1]  # less python -m, hydra
    cfg = compose_job(overrides)
    start = time.perf_counter()
    result = run_the_job(cfg, llm_factory=instant_engine(max_tokens))
    wall = time.perf_counter() - start
    parts = json.loads((out / "run.json").read_text())["runs"][-1]["parts_s"]
    own = wall - parts["load"]
    shown = ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
    line = (f"| job on an instant engine (in process) | {result.rows:,} | "
            f"{result.rows / own:,.0f} ({own / result.rows * 1e6:.0f} µs a row, less the load) | "
            f"{wall:.2f} | {parts['generate']:.2f} | {shown} | - | {_load()} |")  # fmt: skip
    return line, {"wall_s": wall, "us_a_row": own / result.rows * 1e6, "parts_s": parts}


HEADER = (
    "| what | rows | rows/s | wall s | generate s | other parts s | same text | load (1 min) |\n"
    "|---|---:|---:|---:|---:|---|---:|---:|"
)


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def engine_row(e: EngineRun) -> str:
    how = "all at once" if e.window is None else f"in calls of {e.window:,}"
    return (
        f"| engine `LLM.generate` (token ids, {how}) | {e.rows:,} | **{e.rows_s:,.0f}** | "
        f"{e.generate_s:.2f} | {e.generate_s:.2f} | tokenize {e.tokenize_s:.2f} | - | {_load()} |"
    )


def job_rows(j: JobRun, rows: int, same: str, engine: EngineRun | None) -> list[str]:
    """The job's rows: command wall, run.json's wall_s and its generate part, each with its
    ratio to the engine's rows/s."""
    parts = j.run.get("parts_s", {})
    others = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k != "generate")
    lines = []
    for what, seconds in (
        ("job, command wall", j.command_s),
        ("job, run.json wall_s", j.run.get("wall_s")),
        ("job, run.json generate part", parts.get("generate")),
    ):
        rate = j.rows_s(rows, seconds)
        ratio = f" ({rate / engine.rows_s:.2f}x)" if rate and engine else ""
        shown = "-" if rate is None else f"**{rate:,.0f}**{ratio}"
        gen = parts.get("generate")
        lines.append(
            f"| {what} (exit {j.code}) | {rows:,} | {shown} | "
            f"{'-' if seconds is None else f'{seconds:.2f}'} | "
            f"{'-' if gen is None else f'{gen:.2f}'} | {others or '-'} | {same} | {_load()} |"
        )
    return lines


def main() -> None:
    p = parser(__doc__, smoke=False)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--tokens", default="16,40", help="prompt tokens, lo,hi")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1024, help="dataset.window_rows (the job's)")
    p.add_argument("--what", choices=("both", "engine", "job", "overhead"), default="both")
    p.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    p.add_argument("--repeats", type=int, default=1, help="engine and job in turns, each fresh")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch threads in both halves (default: torch's); 1 keeps a shared machine's other "
        "work from stalling the step's threads at each barrier",
    )  # fmt: skip
    p.add_argument("--profile", action="store_true", help="py-spy record one more job run")
    p.add_argument("--job-arg", action="append", default=[], help="one more job override")
    args = p.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    lo, hi = ints(args.tokens)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="short-rows-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = random_model_folder("tiny")
    env = environment()
    print(f"## Short rows: engine and job ({env['date_utc']})\n\nCommand: `{command_line()}`  \n"
          f"{machine(env)}  \nworkdir {workdir}; tiny random model, {lo}-{hi} prompt tokens, "
          f"{args.max_tokens} out, greedy, ignore_eos, one carried column\n",
          flush=True)  # fmt: skip
    data = workdir / f"short-{args.rows}.jsonl"
    if not data.exists():
        from transformers import AutoTokenizer

        log(f"writing {args.rows:,} prompts to {data}")
        write_short_prompts(data, AutoTokenizer.from_pretrained(model), args.rows, (lo, hi),
                            args.seed)  # fmt: skip
    print(HEADER, flush=True)
    results: list[dict[str, Any]] = []

    def record(lines: list[str], **result: Any) -> None:
        print("\n".join(lines), flush=True)
        results.append({**result, "load_1min": os.getloadavg()[0], "rows": args.rows})
        if args.out is not None:  # save_results' file, without its line in the table
            given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            write_json(args.out, {"command": command_line(), "environment": env,
                                  "args": given, "results": results})  # fmt: skip

    if args.what == "overhead":
        for _ in range(args.repeats):
            extra = [f"dataset.window_rows={args.window}", *args.job_arg]
            line, figures = job_overhead(model, data, workdir / "overhead", args.max_tokens, extra)
            record([line], what="overhead", **figures)
        return
    for _ in range(args.repeats):  # the two halves in turns, each run fresh
        engine = None
        if args.what in ("both", "engine"):
            for window in (args.window, None):  # the job's windows, then all at once
                log(f"engine, window {window}")
                engine = run_engine(model, read_prompts(data), args.max_tokens, window)
                record([engine_row(engine)], what="engine", window=window, rows_s=engine.rows_s,
                       generate_s=engine.generate_s, tokenize_s=engine.tokenize_s)  # fmt: skip
            assert engine is not None
            t = engine.prompt_tokens
            log(f"prompt tokens {t[0]}-{t[1]}, mean {t[2]:.1f}")
        if args.what in ("both", "job"):
            log("job")
            extra = [f"dataset.window_rows={args.window}", *args.job_arg]
            cmd = job_command(model, data, workdir / "job", args.max_tokens, extra)
            job = run_job(cmd, workdir / "job", workdir / "job.log", threads=args.threads)
            same = "-"
            if engine is not None and job.code == 0:
                same = "{:,} / {:,}".format(*same_completions(job.out, engine.texts))
            record(job_rows(job, args.rows, same, engine), what="job", exit=job.code,
                   command_s=job.command_s, run_json=job.run, same_text=same)  # fmt: skip
            if job.code != 0:
                log(f"the job failed (exit {job.code}): see {workdir / 'job.log'}")
    if args.what in ("both", "job") and args.profile:
        raw = workdir / "job-profile.txt"
        log(f"profiling one more job run into {raw} (py-spy's raw format)")
        spy = ["py-spy", "record", "--format", "raw", "--rate", "200", "-o", str(raw), "--"]
        profiled = workdir / "job-profiled"
        extra = [f"dataset.window_rows={args.window}", *args.job_arg]
        cmd = job_command(model, data, profiled, args.max_tokens, extra)
        run_job(cmd, profiled, workdir / "job-profiled.log", spy, args.threads)


if __name__ == "__main__":
    main()
