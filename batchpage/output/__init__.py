"""Writing results: shards written whole as rows finish (writer), the files and their schema
(files), the final merge plus run.json (finalize) and the commit point, _SUCCESS (manifest).
Every file goes through the output folder's Store (batchpage.storage): local or a URL."""

from batchpage.output.files import (
    FINAL_FILE,
    JOB_FILE,
    RUN_FILE,
    SUCCESS_FILE,
    IncompleteOutputError,
    OutputDirError,
    ResultRow,
    job_fingerprint,
    output_schema,
    read_job,
    work_dir,
)
from batchpage.output.finalize import FinalizeResult, finalize, package_versions, write_run_json
from batchpage.output.manifest import ManifestError, read_manifest, verify
from batchpage.output.writer import ShardWriter

__all__ = [
    "FINAL_FILE",
    "JOB_FILE",
    "RUN_FILE",
    "SUCCESS_FILE",
    "FinalizeResult",
    "IncompleteOutputError",
    "ManifestError",
    "OutputDirError",
    "ResultRow",
    "ShardWriter",
    "finalize",
    "job_fingerprint",
    "output_schema",
    "package_versions",
    "read_job",
    "read_manifest",
    "verify",
    "work_dir",
    "write_run_json",
]
