"""Writing results: shards written atomically as rows finish (writer), the files and their
schema (files), and the final merge plus run.json (finalize)."""

from batchpage.output.files import (
    FINAL_FILE,
    JOB_FILE,
    RUN_FILE,
    IncompleteOutputError,
    OutputDirError,
    ResultRow,
    job_fingerprint,
    output_schema,
    read_job,
    work_dir,
)
from batchpage.output.finalize import FinalizeResult, finalize, package_versions, write_run_json
from batchpage.output.writer import ShardWriter

__all__ = [
    "FINAL_FILE",
    "JOB_FILE",
    "RUN_FILE",
    "FinalizeResult",
    "IncompleteOutputError",
    "OutputDirError",
    "ResultRow",
    "ShardWriter",
    "finalize",
    "job_fingerprint",
    "output_schema",
    "package_versions",
    "read_job",
    "work_dir",
    "write_run_json",
]
