"""A/B of two engine configurations, or of two revisions, taking turns on the same workloads.

    python -m jobs.bench.ab --a linear_backend=avx512_bf16 --b linear_backend=onednn \\
        --both dtype=bfloat16 --runs 4 --decode-steps 64
    python -m jobs.bench.ab --a prefix_caching=true --b prefix_caching=false --workloads system
    python -m jobs.bench.ab --b-rev HEAD~3 --both dtype=bfloat16      # this tree against HEAD~3
    python -m jobs.bench.ab --smoke                                   # seconds: does it run?
    python -m jobs.bench.ab --model F --a model=Q --both dtype=bfloat16  # two checkpoints

A side is a set of LLM keyword options (--a, --b; --both adds to each), reached only through
batchpage's public API. Without a revision both sides are engines in this process; with --a-rev
or --b-rev each side is a worker process (jobs/bench/engine_runs.py run as a script) importing
batchpage from its own tree: the revision checked out in a git worktree under /tmp, or this
working tree, uncommitted changes included, for a side without one. The workers get the same
token ids and run one at a time.

On a shared, noisy machine two configurations taking turns in one session is the fair way to
see what a change does; a figure from another run or another day is not. For each workload
(jobs/bench/workloads.py; greedy, ignore_eos, so both sides generate the same tokens) both
sides load an engine sized for it, then run the whole workload --runs times each, in turns
(A, B, B, A, A, B, ...). Each run's prompts start with a token of its own, so no run finds blocks
an earlier one cached; within a run the workload's shared prefixes are cached as usual. The
report gives each side's median output tok/s, the ratio, the engine's figures of its last run
(prefill computed, prefix hit rate, preemptions, peak running, KV waste, TTFT) and how many
requests got the same greedy tokens on both sides (two correct engines that sum in different
orders can part at near-ties, in bf16 often).

--decode-steps N also times pure decode steps of --decode-running sequences: every prompt is
prefilled in one step, then each side's decode steps are timed through LLM.generate's on_step
callback (medians per run, then over the runs). A whole run mixes prefill, decode and a tail of
few sequences; this isolates the steps that dominate a long batch job.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from batchpage.engine.config import EngineConfig
from batchpage.model.loader import load_tokenizer, resolve_model_source
from jobs.bench import engine_runs
from jobs.bench.report import command_line, environment, fmt, log, markdown_table, save_results
from jobs.bench.workloads import (
    Workload,
    add_workload_args,
    build_workloads,
    check_workload_args,
    random_workload,
    sharegpt_workload,
)

ROOT = Path(__file__).resolve().parents[2]
STATS = ("prefill_tokens_computed", "prefix_hit_rate", "preemptions", "peak_running", "kv_waste")


# --- sides -------------------------------------------------------------------------------------


class Worker:
    """A side that is a worker process importing batchpage from `tree` (see engine_runs.py)."""

    def __init__(self, model: str, tree: Path, stage: Path, name: str) -> None:
        self.model, self.name = model, name
        stage_tree(tree, stage)
        env = {**os.environ, "PYTHONPATH": str(stage)}
        self.proc = subprocess.Popen(
            [sys.executable, str(stage / "engine_runs.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, cwd=stage, text=True,
        )  # fmt: skip
        self.imported = self._answer()
        for path in filter(None, self.imported.values()):  # batchpage and its kernels
            if not Path(path).is_relative_to(tree.resolve()):
                raise SystemExit(f"side {name}: the worker imported {path}, not {tree}'s")

    def _answer(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"side {self.name}: the worker exited ({self.proc.wait()}); its "
                             "log is above")  # fmt: skip
        answer = json.loads(line)
        if "error" in answer:
            raise SystemExit(f"side {self.name}: {answer['error']}")
        return answer

    def _ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def load(self, label: str, options: dict[str, Any]) -> None:
        self._ask(op="load", model=self.model, label=label, options=options)

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        return self._ask(op="generate", prompts=prompts, max_tokens=max_tokens)

    def decode(self, prompts: list[list[int]], steps: int) -> dict[str, Any]:
        return self._ask(op="decode", prompts=prompts, steps=steps)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def stage_tree(tree: Path, stage: Path) -> None:
    """A folder on whose path `import batchpage` finds `tree`'s package as its wheel lays it out
    (batchpage.kernels from kernels/, ...), beside a copy of engine_runs.py. The editable
    install of this checkout would otherwise answer for the subpackages that live outside
    batchpage/."""
    package = stage / "batchpage"
    package.mkdir(parents=True)
    for entry in (tree / "batchpage").iterdir():
        (package / entry.name).symlink_to(entry)
    # Today batchpage/kernels and batchpage/conf are links (copied above); older revisions
    # mapped them in pyproject: package-dir = { "batchpage.kernels" = "kernels", ... }
    for sub, folder in re.findall(r'"batchpage\.(\w+)"\s*=\s*"([^"]+)"',
                                  (tree / "pyproject.toml").read_text()):  # fmt: skip
        if not (package / sub).exists():
            (package / sub).symlink_to(tree / folder)
    shutil.copy(Path(engine_runs.__file__), stage / "engine_runs.py")


def git(*cmd: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def checkout(rev: str, folder: Path, stack: ExitStack) -> tuple[Path, str]:
    """A git worktree of `rev` in `folder`, removed when the stack closes: (its root, its sha)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    git("worktree", "add", "--detach", str(folder), sha)
    stack.callback(git, "worktree", "remove", "--force", str(folder))
    return folder, sha


def make_sides(args: argparse.Namespace, stack: ExitStack) -> dict[str, dict[str, Any]]:
    """Each side: its runner, its options (--both, then its own) and what it is."""
    sides = {}
    both = engine_runs.parse_options(args.both, "--both")
    workers = bool(args.a_rev or args.b_rev)
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchpage-ab-")))
    for name, items, rev in (("A", args.a, args.a_rev), ("B", args.b, args.b_rev)):
        options = {**both, **engine_runs.parse_options(items, f"--{name.lower()}")}
        # model=PATH on one side: the same workload through another checkpoint of one
        # tokenizer (a quantized and a float one of the same shape).
        model = str(options.pop("model", args.model))
        where = "this working tree" if model == args.model else f"{model}, this working tree"
        if workers:
            tree, sha = (ROOT, None) if rev is None else checkout(rev, tmp / f"tree-{name}", stack)
            where = f"{rev} ({sha[:12]})" if sha else where
            runner: Any = Worker(model, tree, tmp / f"stage-{name}", name)
        else:
            try:
                EngineConfig(**options)  # a bad option fails now, before any engine loads
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"side {name}: {exc}") from exc
            runner = engine_runs.Engine(model)
        stack.callback(runner.close)
        sides[name] = {"runner": runner, "options": options, "where": where}
    return sides


# --- taking turns ------------------------------------------------------------------------------


def salted(prompts: list[list[int]], vocab_size: int, run: int) -> list[list[int]]:
    """The prompts behind a first token of this run's own (from the top of the vocabulary)."""
    return [[vocab_size - 1 - run % (vocab_size - 3), *p] for p in prompts]


def turns(runs: int) -> list[str]:
    """A, B, B, A, A, B, ...: each side goes first in half the runs."""
    return [side for r in range(runs) for side in (("A", "B") if r % 2 == 0 else ("B", "A"))]


def run_workload(sides: dict[str, Any], w: Workload, args: argparse.Namespace, vocab: int):
    for name, side in sides.items():
        options = {"max_model_len": w.max_len + 1, **side["options"]}
        side["runner"].load(f"{name} {w.name}", options)
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for i, name in enumerate(turns(args.runs)):
        run = sides[name]["runner"].generate(salted(w.prompts, vocab, i // 2), w.max_tokens)
        runs[name].append(run)
        log(f"{w.name} {name}: {run['output_tok_s']:.1f} out tok/s")
    last = {name: r[-1] for name, r in runs.items()}
    same = sum(a == b for a, b in zip(last["A"]["tokens"], last["B"]["tokens"], strict=True))
    result: dict[str, Any] = {"workload": w.name, "requests": len(w.prompts), "same_greedy": same}
    for name, r in runs.items():
        rates = [x["output_tok_s"] for x in r]
        result[name] = {"runs_tok_s": rates, "tok_s": statistics.median(rates),
                        "stats": [x["stats"] for x in r]}  # fmt: skip
    result["a_vs_b"] = result["A"]["tok_s"] / result["B"]["tok_s"]
    return result


def run_decode(sides: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace, cfg):
    longest = max(map(len, prompts)) + args.decode_steps + 2
    # float32 K and V of every sequence to its end, with a block of room each
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    defaults = {
        "max_num_seqs": len(prompts), "max_num_batched_tokens": sum(map(len, prompts)),
        "max_model_len": longest, "prefix_caching": False,
        "kv_cache_memory": len(prompts) * (longest + 32) * per_token,
    }  # fmt: skip
    for name, side in sides.items():
        side["runner"].load(f"{name} decode", {**defaults, **side["options"]})
        side["runner"].decode(prompts, 2)  # untimed: the first steps of this batch size
    ms: dict[str, list[float]] = {"A": [], "B": []}
    for name in turns(args.runs):
        steps = sides[name]["runner"].decode(prompts, args.decode_steps)["step_s"]
        ms[name].append(statistics.median(steps) * 1e3)
        log(f"decode {name}: {ms[name][-1]:.2f} ms a step over {len(steps)} steps")
    result = {name: {"runs_ms": v, "ms": statistics.median(v)} for name, v in ms.items()}
    return {"running": len(prompts), "steps": args.decode_steps, **result,
            "a_speedup": result["B"]["ms"] / result["A"]["ms"]}  # fmt: skip


# --- report ------------------------------------------------------------------------------------


def workload_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r in results:
        for name in ("A", "B"):
            last = r[name]["stats"][-1]
            a = name == "A"
            rows.append([r["workload"], name, r[name]["tok_s"], f"{r['a_vs_b']:.3f}x" if a else "",
                         *(fmt(last[k], 3) for k in STATS), fmt(last["ttft_s"]["p50"], 3),
                         f"{r['same_greedy']}/{r['requests']}" if a else ""])  # fmt: skip
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF folder")
    p.add_argument("--a", nargs="*", default=[], metavar="KEY=VALUE", help="side A's options")
    p.add_argument("--b", nargs="*", default=[], metavar="KEY=VALUE", help="side B's options")
    p.add_argument("--both", nargs="*", default=[], metavar="KEY=VALUE", help="both sides'")
    p.add_argument("--a-rev", default=None, help="side A runs this git revision")
    p.add_argument("--b-rev", default=None, help="side B runs this git revision")
    p.add_argument("--runs", type=int, default=4, help="runs per side and workload")
    p.add_argument("--decode-steps", type=int, default=0, help="also time decode steps")
    p.add_argument("--decode-running", type=int, default=64, help="sequences a decode step runs")
    p.add_argument("--decode-prompts", choices=("sharegpt", "random"), default="sharegpt")
    add_workload_args(p, "system,fewshot,sharegpt")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: does it run?")
    args = p.parse_args(argv)
    check_workload_args(p, args)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    if args.smoke:
        args.runs, args.decode_running = 2, 4
        args.decode_steps = args.decode_steps and 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    source = resolve_model_source(args.model)
    tokenizer, vocab = load_tokenizer(source), source.config.vocab_size
    workloads = build_workloads(args, tokenizer, vocab)
    decode = None
    with ExitStack() as stack:
        sides = make_sides(args, stack)
        results = [run_workload(sides, w, args, vocab) for w in workloads]
        if args.decode_steps:
            n = args.decode_running
            if args.decode_prompts == "sharegpt":
                prompts = sharegpt_workload(tokenizer, n, args.seed, args.max_prompt_tokens).prompts
            else:
                lo, hi = (int(x) for x in args.random_prompt_tokens.split(","))
                prompts = random_workload(vocab, n, (lo, hi), 1, args.seed).prompts
            decode = run_decode(sides, prompts, args, source.config)
    env = environment()
    print(f"## A/B in one session ({env['date_utc']})\n")
    print(f"Command: `{command_line()}`\n")
    print(f"Model {args.model}; CPU {env['cpu']} ({', '.join(env['cpu_flags'])}), "
          f"{env['torch_threads']} threads; median of {args.runs} runs a side.\n")  # fmt: skip
    for name, side in sides.items():
        shown = " ".join(f"{k}={v}" for k, v in side["options"].items()) or "(defaults)"
        print(f"- {name}: {shown}, {side['where']}")
    for w in workloads:
        print(f"- {w.name}: {w.description}")
    header = ["workload", "side", "median out tok/s", "A vs B", "prefill computed",
              "prefix hit rate", "preemptions", "peak running", "KV waste", "TTFT p50 s",
              "same greedy"]  # fmt: skip
    print(f"\n{markdown_table(header, workload_rows(results))}")
    if decode:
        print(f"\nDecode steps at {decode['running']} running (median of each run's steps, "
              "then of the runs):\n")  # fmt: skip
        rows = [[decode["running"], f"{decode['A']['ms']:.2f}", f"{decode['B']['ms']:.2f}",
                 f"{decode['a_speedup']:.3f}x"]]  # fmt: skip
        print(markdown_table(["running", "A step ms", "B step ms", "A speedup"], rows))
    if args.out:
        shown = {
            name: {"options": s["options"], "where": s["where"],
                   "batchpage": getattr(s["runner"], "imported", {}).get("batchpage")}
            for name, s in sides.items()
        }  # fmt: skip
        save_results(args.out, env, results, sides=shown, decode=decode,
                     workloads=[w.summary() for w in workloads])  # fmt: skip


if __name__ == "__main__":
    main()
