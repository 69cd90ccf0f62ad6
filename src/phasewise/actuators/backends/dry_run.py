"""The dry-run backend: applies nothing, records and logs each command and says what it would have done."""

from __future__ import annotations

import logging
from collections.abc import Callable

from phasewise.actuators.backends.cgroup import shares_of_weight
from phasewise.actuators.backends.started_jobs import JobRuntime
from phasewise.actuators.commands import Command, Outcome, SetCpuWeight, SetLimits, StartJob, Terminate
from phasewise.kit.cgroups.fs import is_container_name

__all__ = ["DryRunBackend"]

log = logging.getLogger(__name__)


class DryRunBackend:
    """Applies nothing: records and logs each command and reports it applied.

    *usage* reads a container's memory working set (e.g. a real cgroup
    backend's ``memory_usage``, so a dry run on a live host checks the real
    floors); without it usage is unknown and memory limits are dropped by the
    safety rules. *exists* says whether a container exists (the actuator
    passes the cgroup tree's, when there is one, so a missing container is
    rejected as the cgroup backend rejects it); without it every container
    with a managed name counts as existing. A name that is not a managed
    container's never exists.
    """

    name = "dry-run"

    def __init__(self, *, usage: Callable[[str], float | None] | None = None,
                 exists: Callable[[str], bool] | None = None, jobs: JobRuntime | None = None) -> None:
        self._usage = usage
        self._exists = exists
        #: how the cgroup backend would start jobs (``actuator_start_jobs``), for the description
        self.jobs = jobs
        self.commands: list[Command] = []

    def exists(self, container: str) -> bool:
        if not is_container_name(container):
            return False
        return True if self._exists is None else bool(self._exists(container))

    def memory_usage(self, container: str) -> float | None:
        return None if self._usage is None else self._usage(container)

    def apply(self, command: Command) -> Outcome:
        self.commands.append(command)
        log.info("dry run: would apply %r", command)
        if isinstance(command, SetLimits):
            return Outcome.applied("dry run: nothing written", cpu_cores=command.cpu_cores,
                                   mem_bytes=command.mem_bytes)
        if isinstance(command, Terminate):
            how = (f"SIGTERM, then SIGKILL after {command.grace_s:g} s" if command.sigterm and command.grace_s > 0
                   else f"SIGKILL after {command.grace_s:g} s (the job is checkpointing)" if command.grace_s > 0
                   else "SIGKILL at once")
            return Outcome.applied(f"dry run: would stop every process of {command.container!r}: {how}")
        if isinstance(command, StartJob):
            where = command.cpus or "of its container"
            head = (f"dry run: would {'resume' if command.resume else 'start'} {list(command.argv)} in cpuset {where}"
                    + (f" with GPUs {list(command.gpus)}" if command.gpus else ""))
            limits = [x for x in (None if command.cpu_cores is None else f"cpu {command.cpu_cores:g} cores",
                                  None if command.mem_bytes is None else f"memory {command.mem_bytes} bytes") if x]
            if self.jobs is None:
                return Outcome.applied(head + (f", limits {', '.join(limits)}" if limits else ""))
            rt = self.jobs
            return Outcome.applied(
                f"{head} as {rt.who()}, no supplementary groups, no_new_privs, no core dumps; working directory "
                f"{rt.workdir(command.container)}, log {rt.log_path(command.container)}; environment "
                f"{', '.join(sorted(rt.environment(command)))} (nothing else)"
                + (f"; limits {', '.join(limits)}" if limits else ""))
        if isinstance(command, SetCpuWeight):
            return Outcome.applied(f"dry run: would set cpu.weight {command.weight} (cgroup v1: cpu.shares "
                                   f"{shares_of_weight(command.weight)})")
        return Outcome.applied(f"dry run: would {type(command).__name__.lower()}")
