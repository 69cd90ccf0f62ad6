"""Backends carry out the actuator's commands: the cgroup files, a dry run, or the Kubernetes API.

One module each: ``base`` (the protocol), ``cgroup``, ``started_jobs`` (how
the cgroup backend starts a job unprivileged), ``job_watch`` (how it sees
them end), ``dry_run``, ``kubernetes/`` (imported only when chosen) and
``gpu_share_enforcement``; the package
re-exports what the actuator and the apps use. How each command is applied:
docs/operations.md, "Backends".
"""

from phasewise.actuators.backends.base import Backend
from phasewise.actuators.backends.cgroup import (
    CFS_PERIOD_US,
    MIN_QUOTA_US,
    CgroupBackend,
    shares_of_weight,
    weight_of_shares,
)
from phasewise.actuators.backends.dry_run import DryRunBackend
from phasewise.actuators.backends.started_jobs import JOB_PATH, JobExit, JobRuntime, JobSetupError, job_runtime

__all__ = ["CFS_PERIOD_US", "JOB_PATH", "MIN_QUOTA_US", "Backend", "CgroupBackend", "DryRunBackend", "JobExit",
           "JobRuntime", "JobSetupError", "job_runtime", "shares_of_weight", "weight_of_shares"]
