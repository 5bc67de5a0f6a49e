"""The batch job: its config schema (config), the checks made before the model loads (plan),
how rows become prompts (prompts), the window loop (loop), its progress bar (progress), run.json
and the summary (report), and the dry run (dry_run)."""

from batchpage.job.config import JobConfig, register_configs
from batchpage.job.dry_run import dry_run
from batchpage.job.loop import run_job
from batchpage.job.plan import JobConfigError, JobPlan, plan_job
from batchpage.job.report import JobResult

__all__ = [
    "JobConfig",
    "JobConfigError",
    "JobPlan",
    "JobResult",
    "dry_run",
    "plan_job",
    "register_configs",
    "run_job",
]
