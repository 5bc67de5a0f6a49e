"""The batch job: its config schema (config), the checks made before the model loads (plan), the
window loop that generates and writes shards (loop) and the dry run (dry_run)."""

from batchpage.job.config import JobConfig, register_configs
from batchpage.job.dry_run import dry_run
from batchpage.job.loop import JobResult, run_job
from batchpage.job.plan import JobConfigError, JobPlan, plan_job

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
