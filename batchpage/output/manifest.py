"""The commit point of an output_dir: `_SUCCESS`, a JSON manifest of the job's output files.

Readers (Spark, Hadoop, Ray, a nightly pipeline) wait for `_SUCCESS` before they read a folder.
Its JSON has the fields of the manifest Hadoop's S3A committer writes (name, timestamp, date,
hostname, committer, description, jobId, filenames, metrics, diagnostics), and batchpage's own:
each output file (completions.parquet, and the OpenAI Batch files or scores.parquet where the job
wrote them) with its rows, bytes and sha256; the shards merged into it (name, rows, sha256); the
job's fingerprint.

Contract: `_SUCCESS` describes exactly the bytes the store holds. It is written last of the
output files (run.json, the report, comes after it), and deleted (`retract`) before anything
rewrites one of them (finalize, the batch files, scoring, overwrite=true), so a kill at any
moment leaves either no `_SUCCESS` or a true one. `verify` checks that promise.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import pyarrow.parquet as pq

from batchpage.output.files import SUCCESS_FILE
from batchpage.storage import Store

MANIFEST_KIND = "batchpage.output.manifest/1"
_CHUNK = 1 << 20


class FileEntry(NamedTuple):
    """An output file as the manifest lists it: its name in output_dir, rows (lines of a JSONL
    file, rows of a Parquet file), size in bytes and the sha256 of its bytes (hex)."""

    name: str
    rows: int
    bytes: int
    sha256: str


class ShardEntry(NamedTuple):
    """A shard merged into completions.parquet: its name in the working folder, its rows and the
    sha256 of its bytes."""

    name: str
    rows: int
    sha256: str


class ManifestError(ValueError):
    """output_dir has no `_SUCCESS`, or a file differs from what it lists; the message says
    which and how."""


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(store: Store, output_dir: str, name: str, rows: int) -> FileEntry:
    """The entry of one output file, its size and sha256 taken from the bytes the store holds
    (read back, so the manifest describes what is there, not what was meant to be)."""
    size, sha256, _ = _measure(store, store.join(output_dir, name))
    return FileEntry(name, rows, size, sha256)


def _measure(store: Store, path: str) -> tuple[int, str, int]:
    """Size, sha256 and line count of a file, in one streamed read."""
    digest, size, lines = hashlib.sha256(), 0, 0
    with store.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            lines += chunk.count(b"\n")
    return size, digest.hexdigest(), lines


def retract(store: Store, output_dir: str) -> None:
    """Delete `_SUCCESS`: call it before rewriting any file it may list."""
    store.delete(store.join(output_dir, SUCCESS_FILE))


def write_manifest(
    store: Store,
    output_dir: str,
    files: Sequence[FileEntry],
    shards: Iterable[ShardEntry],
    fingerprint: str,
) -> str:
    """Write `_SUCCESS` (whole or not at all) listing `files` and `shards`; its path."""
    from batchpage import __version__

    now = time.time()
    shards = list(shards)
    payload: dict[str, Any] = {
        "name": MANIFEST_KIND,
        "timestamp": int(now * 1000),
        "date": time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime(now)),
        "hostname": platform.node(),
        "committer": "batchpage",
        "description": "batchpage job output, committed once every row had its result",
        "jobId": fingerprint,
        "jobIdSource": ".batchpage/job.json",
        "filenames": [store.join(output_dir, f.name) for f in files],
        "metrics": {
            "rows": files[0].rows if files else 0,
            "bytes": sum(f.bytes for f in files),
            "shards": len(shards),
        },
        "diagnostics": {"batchpage": __version__},
        "fingerprint": fingerprint,
        "files": [f._asdict() for f in files],
        "shards": [s._asdict() for s in shards],
    }
    path = store.join(output_dir, SUCCESS_FILE)
    store.write_bytes(path, (json.dumps(payload, indent=2) + "\n").encode())
    return path


def commit(
    store: Store,
    output_dir: str,
    files: Iterable[tuple[str, int]],
    shards: Iterable[ShardEntry],
    fingerprint: str,
) -> str:
    """Describe each (name, rows) output file as stored and write `_SUCCESS` for them."""
    entries = [describe(store, output_dir, name, rows) for name, rows in files]
    return write_manifest(store, output_dir, entries, shards, fingerprint)


def read_manifest(store: Store, output_dir: str) -> dict[str, Any] | None:
    """`_SUCCESS` as a dict; None when there is none (the output is not committed).
    ManifestError when it is not a manifest batchpage wrote."""
    path = store.join(output_dir, SUCCESS_FILE)
    try:
        data = store.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{path} is not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("name") != MANIFEST_KIND:
        raise ManifestError(f"{path} is not a batchpage manifest ({MANIFEST_KIND})")
    return manifest


def verify(store: Store, output_dir: str) -> dict[str, Any]:
    """The manifest, once every file it lists is checked against the store: its size, sha256
    and rows. ManifestError naming each difference, or a missing `_SUCCESS`."""
    manifest = read_manifest(store, output_dir)
    if manifest is None:
        raise ManifestError(
            f"{store.join(output_dir, SUCCESS_FILE)} is missing: the job writing {output_dir} "
            "has not finished (rerun it to resume)"
        )
    problems = []
    for listed in manifest.get("files", []):
        want = FileEntry(**listed)
        path = store.join(output_dir, want.name)
        try:
            size, sha256, rows = _measure(store, path)
            if sha256 != want.sha256:  # other bytes: their rows say nothing more
                rows = want.rows
            elif want.name.endswith(".parquet"):  # rows from the footer
                with store.open_read(path) as f:
                    rows = pq.ParquetFile(f).metadata.num_rows
        except FileNotFoundError:
            problems.append(f"{want.name} is missing")
            continue
        found = FileEntry(want.name, rows, size, sha256)
        for field in ("bytes", "sha256", "rows"):
            if getattr(found, field) != getattr(want, field):
                problems.append(
                    f"{want.name}'s {field} is {getattr(found, field)}, "
                    f"the manifest says {getattr(want, field)}"
                )
    if problems:
        raise ManifestError(f"{output_dir} differs from its {SUCCESS_FILE}: {'; '.join(problems)}")
    return manifest
