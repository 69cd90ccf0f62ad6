"""Backends carry out the actuator's commands: the cgroup files, a dry run, or the Kubernetes API.

The package re-exports what the actuator and the apps use; each backend is
its own module (:mod:`~phasewise.actuators.backends.base` the protocol,
:mod:`~.cgroup`, :mod:`~.jobs` for started jobs, :mod:`~.dry_run`,
:mod:`~.kubernetes`, imported only when chosen). How they apply each
command: docs/operations.md, "Backends".
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
from phasewise.actuators.backends.jobs import JOB_PATH, Exited, JobRuntime, JobSetupError, job_runtime

__all__ = ["CFS_PERIOD_US", "JOB_PATH", "MIN_QUOTA_US", "Backend", "CgroupBackend", "DryRunBackend", "Exited",
           "JobRuntime", "JobSetupError", "job_runtime", "shares_of_weight", "weight_of_shares"]
