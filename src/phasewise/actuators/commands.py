"""What an actuator can do to a container (frozen commands built by :mod:`phasewise.actuators.safety`), and
the :class:`Outcome` a backend answers with. Nothing here does IO.

>>> SetLimits("job-a", cpu_cores=1.5, mem_bytes=2**30)
SetLimits(container='job-a', cpu_cores=1.5, mem_bytes=1073741824, update_mode='in-place')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATUSES", "Bind", "Command", "Evict", "Freeze", "Outcome", "Scale", "ScaleReplicas", "SetCpuWeight",
           "SetLimits", "StartJob", "Terminate", "Thaw"]

#: the statuses of :class:`phasewise.kit.records.Actuation`
STATUSES = ("applied", "clamped", "duplicate", "rejected", "failed")


@dataclass(frozen=True, slots=True)
class SetLimits:
    """Set a container's CPU (cores) and/or memory (bytes) limit; ``None`` leaves it.

    ``update_mode`` (the workload's ``phasewise.io/update-mode``) matters on Kubernetes only:
    ``in-place`` never evicts for a resize; ``in-place-or-recreate`` evicts the pod when the
    resize is infeasible or stays pending too long (:mod:`phasewise.actuators.backends.kubernetes`).
    """

    container: str
    cpu_cores: float | None = None
    mem_bytes: int | None = None
    update_mode: str = "in-place"


@dataclass(frozen=True, slots=True)
class SetCpuWeight:
    """Set a container's CPU weight: how the CPU its siblings contend for is divided among them.

    In cgroup v2 ``cpu.weight`` units (1..10000, default 100); the cgroup v1
    backend writes the equivalent ``cpu.shares`` (:func:`phasewise.actuators.backends.shares_of_weight`).
    """

    container: str
    weight: int


@dataclass(frozen=True, slots=True)
class Freeze:
    """Stop every process of the container (cgroup freezer) until thawed."""

    container: str


@dataclass(frozen=True, slots=True)
class Thaw:
    """Let a frozen container's processes run again."""

    container: str


@dataclass(frozen=True, slots=True)
class Terminate:
    """Stop every process of the container: SIGTERM, then SIGKILL to whatever is left after *grace_s*.

    ``sigterm=False``: the job was already asked to checkpoint and exit through its
    control channel (a SIGTERM could cut that checkpoint short): the processes get
    *grace_s* to exit on their own, then the SIGKILL. ``grace_s`` 0 is a hard stop.
    """

    container: str
    grace_s: float
    sigterm: bool = True


@dataclass(frozen=True, slots=True)
class StartJob:
    """Start a placed job's command in a new managed container bound to *cpus* (a cpuset list).

    ``resume``: the job was stopped (checkpoint-and-exit) and starts again from
    its checkpoint: its container may exist already, empty (it is reused, with
    its weight and, when *cpus* is ``""``, its cpuset); one that still holds a
    process is not started twice. ``gpus``: the GPU indices it may see
    (``CUDA_VISIBLE_DEVICES``), ``None``: not named (the job gets the
    actuator's own value of the variable, if it has one). ``job``: the job's id
    (its ``PHASEWISE_JOB``; empty: the container's name). ``cpu_cores`` /
    ``mem_bytes``: the limits its cgroup gets before the process starts (the
    job's requests; ``None``: none set). ``env``: variables added to its environment (a GPU share's
    CUDA MPS limits and directories, a service replica's ``PORT``).
    """

    container: str
    cpus: str
    argv: tuple[str, ...]
    gpus: tuple[int, ...] | None = ()
    resume: bool = False
    job: str = ""
    cpu_cores: float | None = None
    mem_bytes: int | None = None
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Evict:
    """Evict the pod holding the container (preemption), honouring its disruption budget."""

    container: str
    grace_period_s: int | None = None


@dataclass(frozen=True, slots=True)
class Bind:
    """Bind a pending pod to a node (placement)."""

    pod: str
    node: str
    namespace: str = "default"
    #: the job the pod must name (``phasewise.io/job``); empty: not checked
    job: str = ""

    @property
    def container(self) -> str:
        return f"{self.namespace}/{self.pod}"


@dataclass(frozen=True, slots=True)
class Scale:
    """Set the replica count of a Deployment (inference replicas)."""

    deployment: str
    replicas: int
    namespace: str = "default"
    #: the most replicas the actuator runs of this service (reported with its ``scaled`` state)
    most: int | None = None

    @property
    def container(self) -> str:
        return f"{self.namespace}/{self.deployment}"


@dataclass(frozen=True, slots=True)
class ScaleReplicas:
    """Run *replicas* local replicas of the service whose first replica is the job in *container*, behind
    one endpoint, 127.0.0.1:*port* (:mod:`phasewise.actuators.backends.replicas`).

    Replica 1 is the placed job itself; replica k > 1 is *start* (the verified spec's command, cpuset,
    GPUs and limits) in its own container, with ``PORT=port+k``. *grace_s*: a stopped replica's time
    between SIGTERM and SIGKILL.
    """

    container: str
    replicas: int
    port: int
    start: StartJob
    grace_s: float
    #: the most replicas the actuator runs of this service (reported with its ``scaled`` state)
    most: int | None = None


Command = SetLimits | SetCpuWeight | Freeze | Thaw | Terminate | StartJob | Evict | Bind | Scale | ScaleReplicas


@dataclass(frozen=True, slots=True)
class Outcome:
    """What came of a decision: one of :data:`STATUSES`, why, and the values now in force.

    ``cpu_cores`` / ``mem_bytes`` are the limits the backend actually set
    (read back where the kernel rounds, e.g. memory to whole pages).
    ``temporary`` marks a failure a retry may fix (the consumer decides
    whether to retry); it is meaningless for other statuses. ``pid``: the
    process a :class:`StartJob` started (``None`` for everything else, and
    for a dry run). ``replicas``: a service's replicas running after a scale command (also after one
    that failed half-way), ``None`` for everything else.
    """

    status: str
    message: str = ""
    cpu_cores: float | None = None
    mem_bytes: int | None = None
    temporary: bool = False
    pid: int | None = None
    replicas: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"outcome status must be one of {STATUSES}, got {self.status!r}")

    @classmethod
    def applied(cls, message: str = "", *, cpu_cores: float | None = None,
                mem_bytes: int | None = None, pid: int | None = None, replicas: int | None = None) -> Outcome:
        return cls("applied", message, cpu_cores, mem_bytes, pid=pid, replicas=replicas)

    @classmethod
    def failed(cls, message: str, *, temporary: bool = False, cpu_cores: float | None = None,
               mem_bytes: int | None = None, replicas: int | None = None) -> Outcome:
        return cls("failed", message, cpu_cores, mem_bytes, temporary, replicas=replicas)
