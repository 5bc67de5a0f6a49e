"""The reliability tables of BENCHMARKS.md: kill -9 trials, bad inputs and GGUF fuzzing.

    python -m jobs.bench.reliability --trials 12 --rows 4 --max-tokens 8 --fuzz 3000

1. A clean run of the job (`--model`, the first `--rows` prompts of `--dataset`, greedy).
2. `--trials` times: the same job into a fresh folder, SIGKILL at a random moment of load,
   generation or the final merge in turn, rerun to the end, and compare with the clean run
   (jobs/bench/kill_trials.py).
3. The bad inputs of jobs/bench/bad_inputs.py: exit code and first line of each message.
4. `--fuzz` mutated GGUF files loaded (jobs/gguf_fuzz.py): how each ended. A crash (an error
   that is not batchpage's own one-line refusal) is counted, not raised.
Markdown tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import random
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from jobs.bench.bad_inputs import run_cases
from jobs.bench.kill_trials import Trial, run_trials
from jobs.bench.report import command_line, cpu_model, log, markdown_table
from jobs.gguf_fuzz import load_outcome, mutate, random_mutations, tiny_gguf


def job_overrides(args: argparse.Namespace) -> list[str]:
    """Small windows and a shard per finished row, so a kill always finds work in flight."""
    return [
        f"dataset={args.dataset}",
        f"dataset.limit={args.rows}",
        "dataset.window_rows=2",
        f"model.path={args.model}",
        f"sampling.max_tokens={args.max_tokens}",
        "sampling.ignore_eos=true",
        "flush_rows=1",
        "progress=false",
        *args.extra,
    ]


def fuzz(count: int, seed: int, workdir: Path) -> tuple[Counter[str], float]:
    """Outcomes of `count` mutated copies of the tiny GGUF, and the seconds it took."""
    valid = tiny_gguf(workdir / "fuzz_valid.gguf")
    load_outcome(valid)  # warm-up, outside the timing
    from batchpage.model.gguf_file import read_gguf_header

    data, header_bytes = valid.read_bytes(), read_gguf_header(valid).data_start
    rng, outcomes, path = random.Random(seed), Counter[str](), workdir / "fuzz.gguf"
    started = time.perf_counter()
    for _ in range(count):
        mutated = data
        for op, pos, value in random_mutations(rng, header_bytes):
            mutated = mutate(mutated, op, pos, value)
        path.write_bytes(mutated)
        try:
            outcomes[load_outcome(path)] += 1
        except Exception as e:  # noqa: BLE001 - a crash is what this counts
            outcomes[f"CRASH {type(e).__name__}"] += 1
    return outcomes, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dataset", default="evals")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--fuzz", type=int, default=3000, help="mutated GGUF files to load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for the job")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="reliability-"))
    workdir.mkdir(parents=True, exist_ok=True)
    job = job_overrides(args)
    print(f"command: `{command_line()}`  \nCPU: {cpu_model()}  \njob: `{' '.join(job)}`\n")

    log(f"clean run and {args.trials} kill trials in {workdir}")
    timeline, trials = run_trials(job, args.trials, workdir, args.seed)
    print(
        f"clean run: first shard at {timeline.first_shard:.1f} s, completions.parquet at "
        f"{timeline.final:.1f} s, exit at {timeline.end:.1f} s\n"
    )
    print(kill_table(trials), "\n")

    log("bad inputs")
    cases = run_cases(job, workdir / "clean", workdir)
    rows = [(c.case, c.exit_code, c.message.replace("|", "\\|"), c.rows_as_clean) for c in cases]
    print(markdown_table(["input", "exit", "first line of the message", "rows"], rows), "\n")

    log(f"fuzzing {args.fuzz} GGUF files")
    outcomes, seconds = fuzz(args.fuzz, args.seed, workdir)
    print(f"{args.fuzz} mutated GGUF files in {seconds:.1f} s:\n")
    print(markdown_table(["outcome", "files"], sorted(outcomes.items(), key=lambda kv: -kv[1])))


def kill_table(trials: list[Trial]) -> str:
    """One row per trial, then the totals. "exit" is the killed run's: -9 when the kill landed."""
    rows: list[list[object]] = [
        [i + 1, t.aimed_at, t.landed, f"{t.at_s:.2f}", t.first_exit, t.shards_left]
        + [t.rerun_exit, t.result.rows, t.result.lost, t.result.duplicated, t.result.different]
        + [t.temps_left]
        for i, t in enumerate(trials)
    ]
    killed = sum(t.first_exit == -signal.SIGKILL for t in trials)
    failed = sum(t.rerun_exit != 0 for t in trials)
    sums = [sum(r[k] for r in rows) for k in range(7, 12)]  # type: ignore[misc]
    rows.append(["all", "", f"{killed} killed", "", "", "", f"{failed} failed", *sums])
    headers = ["trial", "aimed at", "kill landed in", "after s", "exit", "shards kept"]
    more = ["rerun exit", "rows", "lost", "duplicated", "different", "temp files left"]
    return markdown_table([*headers, *more], rows)


if __name__ == "__main__":
    main()
