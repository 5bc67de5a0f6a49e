"""The end of a job: completions.parquet (one row per input row, by index), the commit point
(`_SUCCESS`, manifest.py) and run.json. Everything goes through the output folder's Store."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchpage.output.files import (
    FINAL_FILE,
    RUN_FILE,
    IncompleteOutputError,
    list_shards,
    output_folder,
    output_schema,
    read_each,
    read_job,
    schema_from_text,
    store_of,
)
from batchpage.output.manifest import ShardEntry, commit, retract, sha256_of
from batchpage.storage import Store

VERSIONED_PACKAGES = ("batchpage", "torch", "triton", "transformers", "pyarrow", "datasets")
# Rows merged in memory at once (and a row group of completions.parquet): about what a small
# job holds, so that a large job's merge does not set its peak memory.
ROWS_PER_BUCKET = 16_384


class FinalizeResult(NamedTuple):
    path: str
    rows: int
    errors: int  # rows whose error column is set
    shards: tuple[ShardEntry, ...] = ()  # what was merged, for the manifest


def finalize(
    output_dir: str | os.PathLike,
    total_rows: int,
    *,
    rows_per_bucket: int = ROWS_PER_BUCKET,
    store: Store | None = None,
    commit_now: bool = True,
) -> FinalizeResult:
    """Merge the shards into completions.parquet: exactly rows 0..total_rows-1, by index.

    Raises IncompleteOutputError naming the missing indices (completions.parquet is not written
    then). Rows at index >= total_rows (a run with a larger limit before) are left out. Memory
    stays bounded by `rows_per_bucket`: bigger jobs are sorted bucket by bucket through
    temporary files (Store.scratch). `_SUCCESS` is deleted before completions.parquet is
    rewritten; with `commit_now` it is written again once that is in place, listing it. A job
    that writes more output files passes commit_now=False and commits after the last of them
    (manifest.commit).
    completions.parquet becomes visible whole or not at all (Store.write_stream).
    """
    out = output_folder(output_dir)
    store = store_of(out, store)
    job = read_job(out, store)
    extra = job.get("extra_schema")
    schema = output_schema(
        int(job.get("n", 1)), schema_from_text(extra) if extra else None, listed=job.get("listed")
    )
    shards = list_shards(store, out)
    final = store.join(out, FINAL_FILE)
    written = errors = 0
    bucketed = total_rows > rows_per_bucket
    with store.scratch(out) if bucketed else contextlib.nullcontext(None) as scratch:
        merge = _Merge(schema, total_rows, rows_per_bucket, scratch)
        fetched = read_each(store, [path for _, path in shards])
        for (number, path), data in zip(shards, fetched, strict=True):
            merge.add(number, store.name(path), data)
        merge.check_complete(out)
        retract(store, out)  # completions.parquet is about to change
        with store.write_stream(final) as f, pq.ParquetWriter(f, schema) as writer:
            for table in merge.buckets():
                # Keep each index's first copy: shards are listed in the order they were written.
                _, first = np.unique(table.column("index").to_numpy(), return_index=True)
                table = table.take(pa.array(first))
                writer.write_table(table)
                written += table.num_rows
                errors += table.num_rows - table.column("error").null_count
            if written != total_rows:  # unreachable unless the shards changed under us
                raise IncompleteOutputError(f"merged {written} rows, expected {total_rows}")
    result = FinalizeResult(final, written, errors, tuple(merge.merged))
    if commit_now:
        commit(store, out, [(FINAL_FILE, written)], result.shards, str(job.get("fingerprint", "")))
    return result


class _Merge:
    """The shards' rows by index range: [k*per_bucket, (k+1)*per_bucket) in order, unsorted
    inside. One bucket (the common case) stays in memory; more go through scratch files."""

    def __init__(
        self, schema: pa.Schema, total: int, per_bucket: int, scratch: Path | None
    ) -> None:
        self.schema, self.total, self.per_bucket, self.scratch = schema, total, per_bucket, scratch
        self.present = np.zeros(total, dtype=bool)
        self.tables: list[pa.Table] = []
        self.merged: list[ShardEntry] = []

    def add(self, number: int, name: str, data: bytes) -> None:
        table = pq.read_table(pa.BufferReader(data), schema=self.schema)
        self.merged.append(ShardEntry(name, table.num_rows, sha256_of(data)))
        index = table.column("index").to_numpy()
        kept = index < self.total
        self.present[index[kept]] = True
        table = table.filter(kept)
        if self.scratch is None:
            self.tables.append(table)
            return
        buckets = index[kept] // self.per_bucket
        for b in np.unique(buckets):
            piece = table.filter(buckets == b)
            pq.write_table(piece, self.scratch / f"b{b:09d}-s{number:09d}.parquet")

    def check_complete(self, out: str) -> None:
        if self.present.all():
            return
        missing = np.flatnonzero(~self.present)
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise IncompleteOutputError(
            f"{len(missing)} of {self.total} rows have no output yet (indices {shown}); rerun "
            f"the same job into {out} to generate them (finished rows are kept)"
        )

    def buckets(self) -> Iterator[pa.Table]:
        if self.scratch is None:
            yield pa.concat_tables(self.tables) if self.tables else self.schema.empty_table()
            return
        for b in range(math.ceil(self.total / self.per_bucket)):
            pieces = sorted(self.scratch.glob(f"b{b:09d}-*.parquet"))
            yield pa.concat_tables([pq.read_table(p, schema=self.schema) for p in pieces])


def write_run_json(
    output_dir: str | os.PathLike,
    config: Mapping[str, Any],
    metrics: Mapping[str, Any],
    runs: list[Mapping[str, Any]] | None = None,
    store: Store | None = None,
) -> str:
    """run.json: the resolved config, package versions, the metrics (the totals of a job) and
    the history of its runs (whole or not at all); its path."""
    payload = {
        "config": config,
        "metrics": metrics,
        "runs": runs or [],
        "versions": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = output_folder(output_dir)
    store = store_of(out, store)
    path = store.join(out, RUN_FILE)
    text = json.dumps(_json_safe(payload), indent=2, sort_keys=True, default=str)
    store.write_bytes(path, (text + "\n").encode())
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
