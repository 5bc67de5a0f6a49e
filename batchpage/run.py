"""`python -m batchpage.run dataset=evals ...`: compose the config with Hydra, run the job.

All the work is in batchpage.job; this file only turns Hydra's config into a JobConfig, picks the
output folder, prints the summary and maps failures to exit codes: 0 done (some rows may carry
an error), 1 every row failed or a crash, 2 a config problem found before the model loaded
(message on stderr, no traceback), 130 interrupted by Ctrl-C, 143 stopped by SIGTERM (finished
rows are kept either way; rerun into the same output_dir to resume).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from batchpage.distributed.workers import WorkerDied
from batchpage.job import JobConfigError, JobResult, run_job
from batchpage.job.config import JobConfig, register_configs, to_job
from batchpage.job.dry_run import dry_run, format_report

_MAX_NAME = 120  # file systems allow 255 bytes a name; leave room


def config_dir() -> str:
    """The Hydra config tree: batchpage/conf, in a wheel as in a checkout (there a link to the
    top-level conf/ folder)."""
    return str(Path(__file__).resolve().parent / "conf")


def output_dir_for(output_dir: str | None) -> str:
    """None: Hydra's run folder. A given folder is used as is, except in a sweep (-m), where each
    job gets a subfolder named after its overrides, so the jobs never share one output_dir."""
    hc = HydraConfig.get()
    if output_dir is None:
        return hc.runtime.output_dir
    if hc.mode == RunMode.MULTIRUN:
        return str(Path(output_dir) / sweep_subdir(hc.job.override_dirname, hc.job.num))
    return output_dir


def sweep_subdir(override_dirname: str, num: int) -> str:
    """Named after the job's overrides, so a rerun of the sweep resumes each job's own folder
    even if the values are listed in another order; a long name is cut and given a hash."""
    name = override_dirname.replace("/", "_") or f"job{num}"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[: _MAX_NAME - 13]}-{digest}"
    return name


def compose_job(overrides: Sequence[str] = ()) -> JobConfig:
    """The JobConfig that `python -m batchpage.run <overrides>` would run, for scripts (jobs/)
    and tests. output_dir stays None unless an override sets it. Raises Hydra's errors for an
    unknown key or preset, and ValueError for a bad engine value or a stray `+` key."""
    return to_job(_compose(overrides))


def _compose(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


class Terminated(Exception):
    """SIGTERM (SLURM, Kubernetes, `kill`): unwinds like Ctrl-C, so buffered rows are saved."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _app(cfg: DictConfig) -> None:
    try:
        job = to_job(cfg)
    except ValueError as e:  # a stray `+` key; EngineConfig checks its values when built
        _fail(str(e))
    job.output_dir = output_dir_for(job.output_dir)
    try:
        # Library messages (a kernel build, a tokenizer conversion) print above the bar.
        with sigterm_raises(), logging_redirect_tqdm():
            if job.dry_run:
                _print_report(dry_run(job))
                return
            result = run_job(job)
    except JobConfigError as e:
        _fail(str(e))
    except WorkerDied as e:  # a tensor-parallel rank died: the rows done so far are saved
        print(f"error: {e}; rerun with output_dir={job.output_dir} to resume", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, Terminated) as e:
        stopped = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(
            f"\n{stopped}: finished rows are saved; rerun with output_dir={job.output_dir} "
            "to resume",
            file=sys.stderr,
        )
        sys.exit(143 if isinstance(e, Terminated) else 130)
    print(summary(result))
    if result.rows and result.errors == result.rows:
        print(f"every row failed; the first error: {result.first_error}", file=sys.stderr)
        sys.exit(1)


# What a pooling job did to a row, for its summary.
POOLED = {"embed": "embedded", "classify": "classified", "reward": "scored", "score": "scored"}


def summary(result: JobResult) -> str:
    """The lines the job prints when it ends: for a generation job its finish reasons and
    generated tokens, for a pooling job the prompt tokens it read. Tokens, rates and wall time
    are this run's own (result.this_run): a resumed run does not repeat an earlier run's."""
    m = result.this_run
    done = "generated" if result.task == "generate" else POOLED[result.task]
    lines = [
        f"{result.rows} rows ({result.rows_generated} {done}, {result.rows_resumed} resumed, "
        f"{result.errors} with errors) -> {result.completions}",
    ]
    if result.task == "generate":
        counts = sorted(result.finish_reasons.items())
        reasons = ", ".join(f"{k} {v}" for k, v in counts)
        if result.errors:
            reasons += f"{', ' if reasons else ''}error {result.errors}"
        lines.append(f"finish reasons: {reasons or 'none'}")
    when = " this run" if result.rows_resumed else ""
    tail = f"prefix hit rate {m['prefix_hit_rate']:.0%}, wall time {m['wall_s']:.1f} s"
    if not result.rows_generated:
        lines.append(f"no rows {done} this run, wall time {m['wall_s']:.1f} s")
    elif result.task == "generate":
        lines.append(
            f"{m['generated_tokens']} tokens generated{when} at "
            f"{m['output_tokens_per_s']:.1f} tok/s, {tail}"
        )
    else:
        lines.append(
            f"{m['prompt_tokens']} prompt tokens read{when} at "
            f"{m['total_tokens_per_s']:.1f} tok/s, {tail}"
        )
    if result.first_error:
        lines.append(f"first error: {result.first_error}")
    for sample in result.samples:
        text = sample["completion"]
        text = text[0] if isinstance(text, list) else text
        shown = text if len(text) <= 300 else text[:300] + " ..."
        lines.append(f"--- {sample['id']}\n{shown}")
    if result.score is not None:
        s = result.score
        kept = f", {s['reused']} verdicts kept from before" if s["reused"] else ""
        lines.append(
            f"{s['scorer']} pass@1 {s['pass_at_1']:.1%} ({s['passed']} of {s['samples']} "
            f"samples passed, {s['problems']} problems; {s['checked']} checked this run{kept}) "
            "-> scores.parquet"
        )
        if s["unconfined"]:
            lines.append(f"sandbox was partial here: {'; '.join(s['unconfined'])}")
    return "\n".join(lines)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _print_report(report: dict[str, Any]) -> None:
    print("\n".join(format_report(report)))
    for warning in report.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)


def run_for_script(build: Callable[[], JobConfig]) -> tuple[JobConfig, JobResult] | None:
    """For the scripts under jobs/: build the config and run the job. A user error (bad config,
    path, column, model, pool size) is printed without a traceback and gives None (exit 2)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = build()
        return cfg, run_job(cfg)
    except (JobConfigError, ValueError, HydraException, OmegaConfBaseException) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def run_dir(output_dir: str | None, dry_run: bool = False) -> str:
    """hydra.run.dir (conf/config.yaml): see the comment there. A dry run writes nothing, so it
    gets no outputs/<date>/<time>/ folder either."""
    return "." if output_dir or dry_run else time.strftime("outputs/%Y-%m-%d/%H-%M-%S")


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("batchpage_run_dir"):
        OmegaConf.register_new_resolver("batchpage_run_dir", run_dir)


def main() -> None:
    register_configs()
    register_resolvers()
    _check_overrides(sys.argv[1:])
    hydra.main(config_path=config_dir(), config_name="config", version_base="1.3")(_app)()


def _check_overrides(args: list[str]) -> None:
    """A mistyped key, a wrong type, a value Hydra cannot parse, a sweep without -m or an unknown
    preset fails here in one line with exit 2 that names the key and the fix (Hydra itself
    would exit 1 with a wrapped message). Runs with Hydra's own flags (-m, --cfg, ...) or
    hydra.mode are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(a.startswith(("-", "hydra.mode=")) for a in args):
        return
    parser = OverridesParser.create()
    for arg in args:
        key, equals, value = arg.partition("=")
        try:
            override = parser.parse_override(arg)
        except (HydraException, RecursionError) as e:  # Hydra's parser recurses per nesting
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).strip()
            if not equals:
                _fail(f"{arg!r} is not key=value ({why})")
            _fail(f"{key}: Hydra cannot read the value ({why}); quote it: {_quoted(key, value)}")
        if override.is_sweep_override():
            what = "a sweep over several values"
            if override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
                what = "a sweep over the values between its commas"
            _fail(
                f"{key}: the value makes {what}; to give one value, quote it: "
                f"{_quoted(key, value)}; to run one job per value, add -m"
            )
    try:
        to_job(_compose(args))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        # Hydra wraps OmegaConf's error, whose first line says what is wrong; full_key says where.
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        key = getattr(cause, "full_key", None)
        if key and key not in first:
            first = f"{key}: {first}"
        kind = re.search(r"could not be converted to (\w+)", first)
        if key and kind:
            first += f"; give {key} a value of type {kind.group(1)}"
        _fail(f"{first} (see every key and its type: python -m batchpage.run --cfg job)")


def quoted_override(key: str, value: str) -> str:
    """`key=value` with the value quoted for Hydra (so that commas, brackets, `=` and spaces are
    its text), then quoted for a POSIX shell: `'dataset.path="/tmp/a,b.jsonl"'`."""
    inner = "'" if '"' in value and "'" not in value else '"'
    token = f"{key}={inner}{value.replace(inner, chr(92) + inner)}{inner}"
    if "'" not in token:
        return f"'{token}'"
    return '"' + re.sub(r'(["\\$`])', r"\\\1", token) + '"'


def _quoted(key: str, value: str) -> str:
    """quoted_override for a message: a long value is shown by its ends."""
    shown = quoted_override(key, value)
    return shown if len(shown) <= _MAX_NAME else f"{shown[:60]} ... {shown[-30:]}"


if __name__ == "__main__":
    main()
