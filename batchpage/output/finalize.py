"""The end of a job: completions.parquet (one row per input row, by index) and run.json."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.fileio import atomic_path, atomic_write_text
from batchpage.output.files import (
    FINAL_FILE,
    RUN_FILE,
    IncompleteOutputError,
    list_shards,
    output_schema,
    read_job,
    schema_from_text,
)

VERSIONED_PACKAGES = ("batchpage", "torch", "triton", "transformers", "pyarrow", "datasets")


class FinalizeResult(NamedTuple):
    path: Path
    rows: int
    errors: int  # rows whose error column is set


def finalize(
    output_dir: str | os.PathLike, total_rows: int, *, rows_per_bucket: int = 250_000
) -> FinalizeResult:
    """Merge the shards into completions.parquet: exactly rows 0..total_rows-1, by index.

    Raises IncompleteOutputError naming the missing indices (nothing is written then). Rows at
    index >= total_rows (a run with a larger limit before) are left out. Memory stays bounded by
    `rows_per_bucket`: bigger jobs are sorted bucket by bucket through temp files.
    """
    out = Path(output_dir)
    job = read_job(out)
    extra = job.get("extra_schema")
    schema = output_schema(
        int(job.get("n", 1)), schema_from_text(extra) if extra else None, listed=job.get("listed")
    )
    shards = list_shards(out)
    present = np.zeros(total_rows, dtype=bool)
    for _, path in shards:
        idx = pq.read_table(path, columns=["index"]).column(0).to_numpy()
        present[idx[idx < total_rows]] = True
    if not present.all():
        missing = np.flatnonzero(~present)
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise IncompleteOutputError(
            f"{len(missing)} of {total_rows} rows have no output yet (indices {shown}); rerun the "
            f"same job into {out} to generate them (finished rows are kept)"
        )
    written = errors = 0
    with atomic_path(out / FINAL_FILE) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for table in _sorted_buckets(out, shards, schema, total_rows, rows_per_bucket):
            # Keep each index's first copy: shards are listed in the order they were written.
            _, first = np.unique(table.column("index").to_numpy(), return_index=True)
            table = table.take(pa.array(first))
            writer.write_table(table)
            written += table.num_rows
            errors += table.num_rows - table.column("error").null_count
        if written != total_rows:  # unreachable unless the shards changed under us
            raise IncompleteOutputError(f"merged {written} rows, expected {total_rows}")
    return FinalizeResult(out / FINAL_FILE, written, errors)


def _sorted_buckets(
    out: Path, shards: list[tuple[int, Path]], schema: pa.Schema, total: int, per_bucket: int
) -> Iterator[pa.Table]:
    """Tables covering index ranges [k*per_bucket, (k+1)*per_bucket) in order, unsorted inside."""

    def read(path: Path) -> pa.Table:
        table = pq.read_table(path, schema=schema)
        return table.filter(np.asarray(table.column("index").to_numpy() < total))

    if total <= per_bucket:  # the common case: one bucket, no temp files
        tables = [read(p) for _, p in shards]
        yield pa.concat_tables(tables) if tables else schema.empty_table()
        return
    tmp_dir = Path(tempfile.mkdtemp(prefix=".finalize.", suffix=".tmp", dir=out))
    try:
        for number, path in shards:
            table = read(path)
            buckets = table.column("index").to_numpy() // per_bucket
            for b in np.unique(buckets):
                piece = table.filter(buckets == b)
                pq.write_table(piece, tmp_dir / f"b{b:09d}-s{number:09d}.parquet")
        for b in range(math.ceil(total / per_bucket)):
            pieces = sorted(tmp_dir.glob(f"b{b:09d}-*.parquet"))
            yield pa.concat_tables([pq.read_table(p, schema=schema) for p in pieces])
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_run_json(
    output_dir: str | os.PathLike,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    runs: list[Mapping[str, Any]] | None = None,
) -> Path:
    """run.json: the resolved config, package versions, the metrics (the totals of a job) and
    the history of its runs (atomic)."""
    payload = {
        "config": config,
        "metrics": metrics,
        "runs": runs or [],
        "versions": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = Path(output_dir) / RUN_FILE
    text = json.dumps(_json_safe(payload), indent=2, sort_keys=True, default=str)
    atomic_write_text(path, text + "\n")
    return path


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _json_safe(value: Any) -> Any:
    # NaN/inf are not JSON: a metric that could not be measured is written as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
