"""Linear choices after a busy start against choices measured quiet (#74: within 5%).

    python -m jobs.bench.busy_choices --out jobs/bench/results/busy_choices.json
    python -m jobs.bench.busy_choices --busy 2 --runs 4 --requests 64 --dtype float32
    python -m jobs.bench.busy_choices --smoke                    # about a minute: does it run?

`linear_backend=auto` measures each linear shape at the first start on a setup and caches the
choice. Each start here has a choice cache of its own (a fresh BATCHPAGE_CACHE whose other
entries link to this user's cache, so nothing else is rebuilt):

1. busy start: --busy processes spinning (`while True: pass`) beside it, from an empty cache;
2. after busy: the spinners gone, on the cache the busy start left (what a user's next start
   gets);
3. quiet: from an empty cache on the quiet machine;
4. old cache: the busy start's bound choices written as a cache of before #74 held them (no
   runner-up, no figures), which this revision spot-checks.

Sides 2 to 4 then run the bundled ShareGPT workload (--requests first turns, greedy, each its
real reply's length up to --max-output-tokens) in turns, --runs times each, every run's prompts
behind a token of their own; the report gives each side's median output tok/s and its ratio to
the quiet side, and each start's choices and how they were made (llm.stats'
linear_measurement). Run it on an otherwise quiet machine: the spinners are the only load
meant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from batchpage.model.loader import load_tokenizer, resolve_model_source
from batchpage.paths import cache_dir
from jobs.bench.ab import salted
from jobs.bench.engine_runs import load_llm, log, run_greedy
from jobs.bench.report import environment, markdown_table, parser, print_header, save_results
from jobs.bench.workloads import sharegpt_workload

SIDES = ("after busy", "quiet", "old cache")


def linked_cache(folder: Path) -> Path:
    """A BATCHPAGE_CACHE of its own for one start: every entry of this user's cache linked in,
    but for linear_choices."""
    folder.mkdir(parents=True)
    home = cache_dir()
    if home.is_dir():
        for entry in home.iterdir():
            if entry.name != "linear_choices":
                (folder / entry.name).symlink_to(entry)
    return folder


def start(model: str, label: str, cache: Path, options: dict[str, Any]) -> Any:
    """An engine started on `cache` (loaded and warmed up, so llm.stats names its choices)."""
    os.environ["BATCHPAGE_CACHE"] = str(cache)
    return load_llm(model, label, **options)


def busy_start(model: str, cache: Path, options: dict[str, Any], spinners: int) -> dict:
    """The stats of a start with `spinners` processes spinning beside it."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        time.sleep(1.0)  # under way before the measurement begins
        stats = dict(start(model, "busy start", cache, options).stats)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    return stats


def write_old_cache(cache: Path, template: Path, choices: dict[str, str]) -> bool:
    """The busy start's bound choices in the cache file a start on this setup reads (named
    after `template`'s, the quiet start's), without runner-ups or figures: a cache of before
    #74. False where `template` holds no choice file (nothing measured was trusted)."""
    for path in (template / "linear_choices").glob("*.json"):
        key = json.loads(path.read_text())["key"]
        (cache / "linear_choices").mkdir(exist_ok=True)
        body = {"key": key, "choices": choices}
        (cache / "linear_choices" / path.name).write_text(json.dumps(body))
        return True
    return False


def how_counts(stats: dict[str, Any]) -> str:
    shapes = stats.get("linear_measurement", {}).get("shapes", {})
    counts = Counter(note["how"] for note in shapes.values())
    return ", ".join(f"{n} {how}" for how, n in sorted(counts.items())) or "-"


def main(argv: list[str] | None = None) -> None:
    p: argparse.ArgumentParser = parser(__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside the busy start")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-output-tokens", type=int, default=96)
    p.add_argument("--runs", type=int, default=4, help="runs per side")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.max_output_tokens, args.runs = 4, 8, 1
    source = resolve_model_source(args.model)
    w = sharegpt_workload(load_tokenizer(source), args.requests, 0, 256, args.max_output_tokens)
    cfg = source.config
    # K and V of every request to its end (each engine holds its own pool; three at once)
    kv = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * (w.max_len + 32) * len(w.prompts)
    )
    options = {"dtype": args.dtype, "linear_backend": "auto", "max_model_len": w.max_len + 1,
               "kv_cache_memory": kv}  # fmt: skip
    env, vocab = environment(), cfg.vocab_size
    with tempfile.TemporaryDirectory(prefix="busy_choices_") as tmp:
        caches = {n: linked_cache(Path(tmp) / n.replace(" ", "_")) for n in ("busy", *SIDES)}
        caches["after busy"] = caches["busy"]
        stats = {"busy start": busy_start(args.model, caches["busy"], options, args.busy)}
        llms = {"quiet": start(args.model, "quiet", caches["quiet"], options)}
        busy_choices = stats["busy start"]["linear_methods"]
        sides = list(SIDES)
        if not write_old_cache(caches["old cache"], caches["quiet"], busy_choices):
            log("the quiet start trusted no measurement: no old cache to write")
            sides.remove("old cache")
        for name in sides:
            if name not in llms:
                llms[name] = start(args.model, name, caches[name], options)
        stats |= {n: dict(llm.stats) for n, llm in llms.items()}
        rates: dict[str, list[float]] = {n: [] for n in sides}
        for run in range(args.runs):
            for i in range(len(sides)):  # each side first in turn
                name = sides[(run + i) % len(sides)]
                out = run_greedy(llms[name], salted(w.prompts, vocab, run), w.max_tokens)
                rates[name].append(out["output_tok_s"])
                log(f"{name}: {out['output_tok_s']:.1f} out tok/s")
    tok_s = {n: statistics.median(r) for n, r in rates.items()}
    print_header("Linear choices after a busy start", env, f"{args.busy} spinning processes")
    print(f"Model {args.model}, {args.dtype}; {w.description}; median of {args.runs} runs.\n")
    rows = [["busy start", "-", "-", how_counts(stats["busy start"])]]
    rows += [
        [n, tok_s[n], f"{tok_s[n] / tok_s['quiet']:.3f}x", how_counts(stats[n])] for n in sides
    ]
    print(markdown_table(["start", "median out tok/s", "vs quiet", "choices"], rows))
    starts = ["busy start", *sides]
    shapes = sorted({s for n in starts for s in stats[n]["linear_methods"]})
    table = [[s, *(stats[n]["linear_methods"].get(s, "-") for n in starts)] for s in shapes]
    print("\n" + markdown_table(["shape", *starts], table))
    measurement = {n: stats[n].get("linear_measurement", {}) for n in starts}
    results = {"tok_s": tok_s, "runs_tok_s": rates, "vs_quiet": {n: tok_s[n] / tok_s["quiet"]
               for n in sides}, "linear_methods": {n: stats[n]["linear_methods"] for n in starts},
               "linear_measurement": measurement}  # fmt: skip
    save_results(args.out, env, results, args, workload=w.summary())


if __name__ == "__main__":
    main()
