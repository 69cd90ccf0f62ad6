"""Safety rules of applying, pure: turn a Decision into a command the actuator may carry out, or refuse it.

The caller passes what it observed (whether the container exists, its memory
working set, the host's cores) and gets :class:`Planned` (a command, with a
note for every limit a rule changed, which makes the actuation ``clamped``)
or :class:`Rejected` (a reason). The rules in order: docs/operations.md,
"Safety rules of applying".
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from phasewise.actuators.commands import (
    Bind,
    Command,
    Freeze,
    Scale,
    ScaleReplicas,
    SetCpuWeight,
    SetLimits,
    StartJob,
    Terminate,
    Thaw,
)
from phasewise.actuators.job_trust import verify_start
from phasewise.kit.cgroups.fs import is_container_name  # the one definition of a managed name
from phasewise.kit.job_signing import SubmitterKeys
from phasewise.kit.records import MAX_BYTES, Decision, WorkloadPolicy
from phasewise.kit.settings import Settings
from phasewise.kit.units import fmt_bytes, fmt_cores

__all__ = [
    "Bounded",
    "Cap",
    "Floor",
    "PeakTracker",
    "Planned",
    "Rejected",
    "Requested",
    "Rule",
    "Unsafe",
    "cpu_rule",
    "declared_peak",
    "is_managed_name",
    "mem_rule",
    "not_applied_reason",
    "format_cpuset",
    "parse_cpuset",
    "plan",
    "plan_place",
    "plan_scale",
    "plan_terminate",
    "plan_weight",
    "workload_cpu_rule",
    "workload_mem_rule",
]

SUPPORTED_ACTIONS = ("limit", "freeze", "thaw", "terminate", "place", "weight", "share", "scale")


@dataclass(frozen=True, slots=True)
class Planned:
    """A command that passed the rules; ``notes`` says what each clamp changed."""

    command: Command
    notes: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        return "clamped" if self.notes else "applied"

    @property
    def message(self) -> str:
        return "; ".join(self.notes)


@dataclass(frozen=True, slots=True)
class Rejected:
    """The decision must not be applied, and why."""

    reason: str
    status: str = "rejected"


class Unsafe(ValueError):
    """A requested limit no rule can make safe (NaN, infinite, negative)."""


# --------------------------------------------------------------------------- composable limit rules


@dataclass(frozen=True, slots=True)
class Bounded:
    """A limit value and the notes of every rule that changed it."""

    value: float
    notes: tuple[str, ...] = ()


class Rule(Protocol):
    def __call__(self, requested: float) -> Bounded: ...


Fmt = Callable[[float], str]
#: how the rules' messages write cores and bytes ("1.5 cores", "64.0 MiB")
cores_text: Fmt = partial(fmt_cores, words=True)
bytes_text: Fmt = partial(fmt_bytes, words=True)


@dataclass(frozen=True, slots=True)
class Requested:
    """The innermost rule: the requested value itself, if it is a finite number >= 0."""

    what: str
    fmt: Fmt = cores_text

    def __call__(self, requested: float) -> Bounded:
        if not isinstance(requested, (int, float)) or isinstance(requested, bool):
            raise Unsafe(f"{self.what} limit must be a number, got {type(requested).__name__}")
        if not math.isfinite(requested) or requested < 0:
            raise Unsafe(f"{self.what} limit {requested!r} is not a finite number >= 0")
        return Bounded(float(requested))


@dataclass(frozen=True, slots=True)
class Floor:
    """Raise the inner rule's value to at least ``minimum``."""

    inner: Rule
    minimum: float
    why: str

    def __call__(self, requested: float) -> Bounded:
        b = self.inner(requested)
        if b.value >= self.minimum:
            return b
        fmt = _fmt_of(self.inner)
        note = f"{_what_of(self.inner)} {fmt(b.value)} raised to {self.why} ({fmt(self.minimum)})"
        return Bounded(self.minimum, b.notes + (note,))


@dataclass(frozen=True, slots=True)
class Cap:
    """Lower the inner rule's value to at most ``maximum``."""

    inner: Rule
    maximum: float
    why: str

    def __call__(self, requested: float) -> Bounded:
        b = self.inner(requested)
        if b.value <= self.maximum:
            return b
        fmt = _fmt_of(self.inner)
        note = f"{_what_of(self.inner)} {fmt(b.value)} lowered to {self.why} ({fmt(self.maximum)})"
        return Bounded(self.maximum, b.notes + (note,))


def _innermost(rule: Rule) -> Requested:
    while not isinstance(rule, Requested):
        rule = rule.inner  # type: ignore[attr-defined]
    return rule


def _fmt_of(rule: Rule) -> Fmt:
    return _innermost(rule).fmt


def _what_of(rule: Rule) -> str:
    return _innermost(rule).what


def cpu_rule(settings: Settings, host_cores: float, workload: WorkloadPolicy | None = None) -> Rule:
    """CPU cores clamped into the workload's bounds, then ``[cpu_floor_cores, host_cores]`` (the floor wins)."""
    return Floor(
        Cap(workload_cpu_rule(Requested("cpu", cores_text), workload), host_cores, "the host's cores"),
        settings.actuator.cpu_floor_cores,
        "the CPU floor",
    )


def mem_rule(settings: Settings, usage_mem_bytes: float, peak_mem_bytes: float | None = None,
             workload: WorkloadPolicy | None = None) -> Rule:
    """Memory never below the static floor nor below current usage (or the recent peak, when higher) + margin."""
    a = settings.actuator
    margin = bytes_text(a.mem_margin_bytes)
    if peak_mem_bytes is not None and peak_mem_bytes > usage_mem_bytes:
        need = peak_mem_bytes + a.mem_margin_bytes
        why = f"the recent peak {bytes_text(peak_mem_bytes)} + margin {margin}"
    else:
        need = usage_mem_bytes + a.mem_margin_bytes
        why = f"current usage {bytes_text(usage_mem_bytes)} + margin {margin}"
    floor = Floor(workload_mem_rule(Requested("memory", bytes_text), workload), a.mem_floor_bytes,
                  "the memory floor")
    return Floor(floor, need, why)


def workload_cpu_rule(inner: Rule, workload: WorkloadPolicy | None) -> Rule:
    """*inner* bounded by the workload's own ``cpu-max`` and ``cpu-min`` (the host's rules wrap this)."""
    if workload is None:
        return inner
    if workload.cpu_max_cores is not None:
        inner = Cap(inner, workload.cpu_max_cores, "the workload's cpu-max")
    if workload.cpu_min_cores is not None:
        inner = Floor(inner, workload.cpu_min_cores, "the workload's cpu-min")
    return inner


def workload_mem_rule(inner: Rule, workload: WorkloadPolicy | None) -> Rule:
    """*inner* bounded by the workload's own ``memory-min`` and ``memory-max``."""
    if workload is None:
        return inner
    if workload.mem_min_bytes is not None:
        inner = Floor(inner, workload.mem_min_bytes, "the workload's memory-min")
    if workload.mem_max_bytes is not None:
        inner = Cap(inner, workload.mem_max_bytes, "the workload's memory-max")
    return inner


def not_applied_reason(container: str, workload: WorkloadPolicy) -> str:
    """Why a decision for a container whose mode is not ``apply`` is refused.

    >>> not_applied_reason("c1", WorkloadPolicy(mode="recommend", source="annotation"))
    "container 'c1' is in recommend mode (from annotation): decisions are published, never written"
    """
    if workload.mode == "recommend":
        return (f"container {container!r} is in recommend mode (from {workload.source}): "
                "decisions are published, never written")
    why = f"; its settings were refused: {workload.error}" if workload.error else ""
    return f"container {container!r} is not opted in (mode {workload.mode}, from {workload.source}){why}"


class PeakTracker:
    """The highest memory working set read per container over the last *window_s* seconds.

    >>> p = PeakTracker(window_s=60)
    >>> p.add("job", 0.0, 5e8); p.add("job", 30.0, 2e8)
    >>> p.peak("job", 59.0), p.peak("job", 61.0), p.peak("other", 61.0)
    (500000000.0, 200000000.0, None)
    """

    def __init__(self, window_s: float, max_containers: int = 100_000) -> None:
        self.window_s = float(window_s)
        self.max_containers = max_containers
        self._seen: dict[str, deque[tuple[float, float]]] = {}

    def add(self, container: str, t: float, working_set: float) -> None:
        pts = self._seen.get(container)
        if pts is None:
            if len(self._seen) >= self.max_containers:  # bounded: forget the container seen least recently
                oldest = min(self._seen, key=lambda c: self._seen[c][-1][0])
                del self._seen[oldest]
            pts = self._seen[container] = deque()
        # keep a decreasing staircase: a reading hides the older, smaller ones (max over a window)
        while pts and pts[-1][1] <= working_set:
            pts.pop()
        pts.append((t, float(working_set)))

    def peak(self, container: str, t: float) -> float | None:
        pts = self._seen.get(container)
        if not pts:
            return None
        while pts and pts[0][0] < t - self.window_s:
            pts.popleft()
        return pts[0][1] if pts else None


def declared_peak(decision: Decision) -> float | None:
    """The recent peak working set a decision declares (``details.safety.peak_mem_bytes``), if a sane number."""
    safety = decision.details.get("safety") if isinstance(decision.details, dict) else None
    v = safety.get("peak_mem_bytes") if isinstance(safety, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(min(v, MAX_BYTES))


# --------------------------------------------------------------------------- the plan


def is_managed_name(container: str) -> bool:
    """A single cgroup name relative to the managed prefix (:func:`phasewise.kit.cgroups.fs.is_container_name`:
    no ``/``, no ``..``, no whitespace or trailing newline, a documented character set)."""
    return is_container_name(container)


def plan(
    decision: Decision,
    *,
    exists: bool,
    usage_mem_bytes: float | None,
    host_cores: float,
    settings: Settings,
    peak_mem_bytes: float | None = None,
    workload: WorkloadPolicy | None = None,
    host_cpus: frozenset[int] | None = None,
    now: float | None = None,
    terminated: str | None = None,
    submitters: SubmitterKeys | None = None,
    owned_by: str | None = None,
    kubernetes: bool = False,
    started_spec: str | None = None,
) -> Planned | Rejected:
    """The command for *decision* under the safety rules, or why it is refused.

    *exists*: whether the container exists under the managed prefix now;
    *usage_mem_bytes*: its memory working set (``None`` = unknown);
    *peak_mem_bytes*: its recent peak working set (``None`` = unknown);
    *host_cores*: CPUs of this host, the highest CPU limit worth setting;
    *workload*: the container's per-workload policy, whose min/max bound the limits.
    *host_cpus*: the CPU ids this host may bind jobs to (``place`` decisions).
    *now*, *terminated*: see :func:`plan_terminate` (``terminate`` decisions).
    *submitters*, *owned_by*: see :func:`plan_place` (``place`` decisions; *now* too) and
    :func:`plan_scale` (``scale`` decisions, with *kubernetes* and *started_spec*).
    """
    c = decision.container
    if not is_managed_name(c):
        return Rejected(f"container id {c!r} is not a managed container name "
                        "(a single cgroup name under the managed prefix)")
    if decision.action == "place":
        return plan_place(decision, exists=exists, host_cpus=host_cpus, submitters=submitters, settings=settings,
                          now=now, owned_by=owned_by, kubernetes=kubernetes)
    if decision.action == "scale":
        return plan_scale(decision, exists=exists, submitters=submitters, settings=settings,
                          now=decision.ts if now is None else now, owned_by=owned_by, kubernetes=kubernetes,
                          started_spec=started_spec)
    if not exists:
        return Rejected(f"container {c!r} does not exist under the managed prefix")
    if decision.action == "freeze":
        return Planned(Freeze(c))
    if decision.action == "thaw":
        return Planned(Thaw(c))
    if decision.action == "terminate":
        return plan_terminate(decision, settings=settings, now=decision.ts if now is None else now,
                              terminated=terminated)
    if decision.action == "weight":
        return plan_weight(decision, settings=settings)
    if decision.action != "limit":
        return Rejected(f"action {decision.action!r} is not performed by this actuator "
                        f"(it performs {', '.join(SUPPORTED_ACTIONS)})")

    cpu, mem = decision.cpu_limit_cores, decision.mem_limit_bytes
    if cpu is None and mem is None:
        return Rejected("limit decision carries no limits (cpu_limit_cores and mem_limit_bytes are null)")

    notes: list[str] = []
    cpu_out: float | None = None
    mem_out: int | None = None
    try:
        if cpu is not None:
            if not (isinstance(host_cores, (int, float)) and math.isfinite(host_cores) and host_cores > 0):
                return Rejected(f"the host's core count {host_cores!r} is unknown; cannot bound a CPU limit")
            b = cpu_rule(settings, host_cores, workload)(cpu)
            cpu_out, notes = b.value, notes + list(b.notes)
        if mem is not None:
            if usage_mem_bytes is None or not math.isfinite(usage_mem_bytes) or usage_mem_bytes < 0:
                why = f"memory limit dropped: current memory usage of {c!r} is unknown, so it cannot be checked"
                if cpu_out is None:
                    return Rejected(why)
                notes.append(why)
            else:
                b = mem_rule(settings, usage_mem_bytes, peak_mem_bytes, workload)(mem)
                mem_out, notes = math.ceil(b.value), notes + list(b.notes)
    except Unsafe as e:
        return Rejected(str(e))
    mode = (workload.update_mode if workload is not None else None) or "in-place"
    return Planned(SetLimits(c, cpu_cores=cpu_out, mem_bytes=mem_out, update_mode=mode), tuple(notes))


_CPULIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpuset(text: str) -> frozenset[int]:
    """The CPU ids of a cpuset list (``0-3,6``); ValueError when it is not one.

    >>> sorted(parse_cpuset("0-2,5"))
    [0, 1, 2, 5]
    """
    if not isinstance(text, str) or not _CPULIST.match(text):
        raise ValueError(f"{text!r} is not a cpuset list (e.g. 0-3,6)")
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi - lo > 4096:
            raise ValueError(f"{text!r}: range {part} is empty or absurd")
        out.update(range(lo, hi + 1))
    return frozenset(out)


def format_cpuset(cpus: frozenset[int] | set[int]) -> str:
    """A cpuset list of CPU ids, ranges joined.

    >>> format_cpuset({0, 1, 2, 5, 7, 8})
    '0-2,5,7-8'
    """
    out: list[str] = []
    for c in sorted(cpus):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == c - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        elif out and "-" not in out[-1] and int(out[-1]) == c - 1:
            out[-1] = f"{out[-1]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def plan_place(decision: Decision, *, exists: bool, host_cpus: frozenset[int] | None,
               submitters: SubmitterKeys | None = None, settings: Settings | None = None, now: float | None = None,
               owned_by: str | None = None, kubernetes: bool = False) -> Planned | Rejected:
    """A ``place`` decision as a :class:`StartJob` (*kubernetes*: a :class:`Bind` of the job's pod to this
    node), or why not.

    First the job must be one a trusted submitter signed
    (:func:`~phasewise.actuators.job_trust.verify_start`, with *submitters*,
    *settings*, *now* and *owned_by*): the command started is the verified
    spec's, never one an agent wrote. The job's container must not exist yet
    (it is created for it), unless ``details.resume`` is true: a job stopped by
    checkpoint-and-exit starts again in its container (the backend refuses one
    that still holds a process: a job runs once). ``details.cpuset`` is a
    cpuset list within *host_cpus*, or absent (null): every CPU of *host_cpus*
    for a new container, the container's own cpuset for a resumed one (the
    priority agent decides who runs, not on which CPUs). ``details.device`` is
    a list of GPU indices (ints >= 0; absent: none; null: not named, the job
    sees what the actuator sees).
    """
    c, d = decision.container, decision.details or {}
    settings = Settings() if settings is None else settings
    job = verify_start(decision, submitters=submitters, settings=settings,
                       now=decision.ts if now is None else now, owned_by=owned_by, pod=kubernetes)
    if isinstance(job, str):
        return Rejected(job)
    if kubernetes:  # the kubelet starts the pod's containers; the signed spec names the pod, never an agent
        if job.spec.pod is None:
            return Rejected(f"place decision for {c!r}: job {job.job!r} names no pod (spec.pod NAMESPACE/NAME): "
                            "on Kubernetes a placed job is a pending pod that its place decision binds to the node")
        namespace, _, pod = job.spec.pod.partition("/")
        return Planned(Bind(pod, decision.host, namespace, job=job.job))
    resume = decision.is_resume
    if exists and not resume:
        return Rejected(f"container {c!r} already exists: a placed job is started once")
    cpus, dev = d.get("cpuset"), d.get("device", [])
    if not host_cpus:
        return Rejected("this host's CPUs are unknown; cannot bind a job to a cpuset")
    if cpus is None:
        cpus = "" if exists else format_cpuset(host_cpus)
    else:
        try:
            want = parse_cpuset(cpus)
        except ValueError as e:
            return Rejected(f"place decision for {c!r}: details.cpuset {e}")
        if not want <= host_cpus:
            return Rejected(f"place decision for {c!r}: cpuset {cpus} is not within this host's CPUs "
                            f"{sorted(host_cpus)}")
    if dev is not None and not (isinstance(dev, list) and all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in dev)):
        return Rejected(f"place decision for {c!r}: details.device must be a list of GPU indices (or null)")
    r = job.spec.requests  # the job starts with its signed requests as limits (the limits policy moves them later)
    svc = job.spec.service  # a service's first replica listens on its port + 1, behind the endpoint
    return Planned(StartJob(c, cpus, job.argv, None if dev is None else tuple(dev), resume=resume, job=job.job,
                            cpu_cores=r.cpu_cores or None, mem_bytes=int(r.mem_bytes) if r.mem_bytes else None,
                            env=(("PORT", str(svc.port + 1)),) if svc is not None else ()))


def plan_scale(decision: Decision, *, exists: bool, submitters: SubmitterKeys | None, settings: Settings,
               now: float, owned_by: str | None = None, kubernetes: bool = False,
               started_spec: str | None = None) -> Planned | Rejected:
    """A ``scale`` decision as a :class:`ScaleReplicas` (local replicas) or a :class:`Scale` (a Deployment's
    scale subresource), or why not.

    The replicas run the service's signed spec, so the decision carries its job's signed start details
    and passes the same rules as a ``place`` (:func:`~phasewise.actuators.job_trust.verify_start`); locally
    the service's container must be one this actuator started for that job (*owned_by*) from the same
    spec (*started_spec*, the digest in its registry), whose age then no longer matters (it was fresh
    when it started). The spec must have a ``service`` section
    (on Kubernetes with its ``deployment``). ``details.replicas`` (an integer) is held in
    ``[1, min(service.max_replicas, actuator_max_replicas)]`` locally (replica 1 is the job itself:
    stopping it is a ``terminate``), in ``[0, ...]`` on Kubernetes; each bound that changed it is a note
    (``clamped``).

    The rules in order: docs/priorities.md, "Inference autoscaling".
    """
    c, d = decision.container, decision.details if isinstance(decision.details, dict) else {}
    n = d.get("replicas")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return Rejected(f"scale decision for {c!r}: details.replicas {n!r} is not an integer >= 0")
    if not kubernetes:
        if not exists:
            return Rejected(f"scale decision for {c!r}: the service's container does not exist under the managed "
                            "prefix (its first replica is started by its place decision)")
        job = d.get("job")
        if owned_by is None or owned_by != job:
            return Rejected(f"scale decision for {c!r}: the container was not started by this actuator for job "
                            f"{job!r}: its replicas are not started")
        if started_spec is None or d.get("spec_digest") != started_spec:
            return Rejected(f"scale decision for {c!r}: its spec is not the spec its first replica was started "
                            "with: its replicas run that one command only")
        settings = settings.replace(job_spec_max_age_s=0)  # the job started here when its spec was fresh
    job = verify_start(decision, submitters=submitters, settings=settings, now=now, owned_by=owned_by)
    if isinstance(job, str):
        return Rejected(job.replace("place decision", "scale decision"))
    svc = job.spec.service
    if svc is None or d.get("workload") != "inference":
        return Rejected(f"scale decision for {c!r}: job {job.job!r} is not an inference service (its signed spec "
                        "has no service section)")
    notes: list[str] = []
    want = n
    most = settings.actuator.max_replicas
    cap = min(svc.max_replicas or most, most)
    why = "its signed spec's service.max_replicas" if svc.max_replicas and svc.max_replicas < most else \
        "actuator_max_replicas"
    if want > cap:
        notes.append(f"replicas {want} lowered to {why} ({cap})")
        want = cap
    if kubernetes:
        if svc.deployment is None:
            return Rejected(f"scale decision for {c!r}: job {job.job!r}'s service names no Kubernetes Deployment "
                            "(service.deployment)")
        namespace, _, name = svc.deployment.partition("/")
        return Planned(Scale(name, want, namespace, most=cap), tuple(notes))
    if want < 1:
        notes.append(f"replicas {want} raised to 1: replica 1 is the job itself (a terminate decision stops it)")
        want = 1
    dev = d.get("device", [])
    if not (isinstance(dev, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in dev)):
        return Rejected(f"scale decision for {c!r}: details.device must be a list of GPU indices")
    r = job.spec.requests  # each replica: the first one's cpuset (the backend reads it), these GPUs, its requests
    start = StartJob(c, "", job.argv, tuple(dev), job=job.job, cpu_cores=r.cpu_cores or None,
                     mem_bytes=int(r.mem_bytes) if r.mem_bytes else None)
    return Planned(ScaleReplicas(c, want, svc.port, start, float(min(settings.actuator.terminate_grace_s,
                                                                     settings.actuator.terminate_grace_max_s)),
                                 most=cap), tuple(notes))


def plan_weight(decision: Decision, *, settings: Settings) -> Planned | Rejected:
    """A ``weight`` decision as a :class:`SetCpuWeight`, or why not.

    ``details.cpu_weight`` (cgroup v2 ``cpu.weight`` units) must be a finite
    number >= 0; it is rounded to a whole number and held in
    ``[cpu_weight_min, cpu_weight_max]`` (a note each: ``clamped``).

    >>> from phasewise.kit.settings import Settings
    >>> s = Settings().replace(cpu_weight_min=10, cpu_weight_max=5000)
    >>> d = Decision(id="w", ts=1.0, host="h", container="job-a", action="weight", policy="priority",
    ...              details={"cpu_weight": 10000})
    >>> p = plan_weight(d, settings=s)
    >>> p.command, p.message
    (SetCpuWeight(container='job-a', weight=5000), 'cpu weight 10000 lowered to cpu_weight_max (5000)')
    """
    c, d = decision.container, decision.details if isinstance(decision.details, dict) else {}
    a = settings.actuator
    rule = Floor(Cap(Requested("cpu weight", _weight_text), a.cpu_weight_max, "cpu_weight_max"),
                 a.cpu_weight_min, "cpu_weight_min")
    try:
        b = rule(d.get("cpu_weight"))
    except Unsafe as e:
        return Rejected(f"weight decision for {c!r}: {e}")
    return Planned(SetCpuWeight(c, int(round(b.value))), b.notes)


def _weight_text(v: float) -> str:
    return f"{v:g}"


def plan_terminate(decision: Decision, *, settings: Settings, now: float,
                   terminated: str | None = None) -> Planned | Rejected:
    """A ``terminate`` decision as a :class:`Terminate`, or why not.

    *terminated*: how this actuator already terminated the container, if it did
    (since it last started it): a container is terminated once, so a second
    decision (another policy's, a replay under a new id) is refused. The grace
    period is the decision's ``details.grace_s`` (a finite number >= 0), else
    ``terminate_grace_s``. ``details.mode == "checkpoint"`` means the job was
    asked at the decision's time to checkpoint and exit through its control
    channel: it gets no SIGTERM (which could cut the checkpoint short), only what
    is left of the grace counted from the decision's time (*now*), then the
    SIGKILL. The actuator waits the grace out, so it is never more than
    ``terminate_grace_max_s`` (a note: ``clamped``).

    >>> from phasewise.kit.settings import Settings
    >>> s = Settings().replace(terminate_grace_s=10, terminate_grace_max_s=30)
    >>> d = Decision(id="t1", ts=100.0, host="h", container="job-a", action="terminate", policy="targets")
    >>> plan_terminate(d, settings=s, now=100.0).command
    Terminate(container='job-a', grace_s=10.0, sigterm=True)
    >>> d = Decision(id="t2", ts=100.0, host="h", container="job-a", action="terminate", policy="priority",
    ...              details={"mode": "checkpoint", "grace_s": 45})
    >>> p = plan_terminate(d, settings=s, now=105.0)
    >>> p.command, p.status
    (Terminate(container='job-a', grace_s=30.0, sigterm=False), 'clamped')
    >>> plan_terminate(d, settings=s, now=105.0, terminated="by decision t1").reason
    "container 'job-a' was already terminated (by decision t1): a container is terminated once"
    """
    c = decision.container
    if terminated is not None:
        return Rejected(f"container {c!r} was already terminated ({terminated}): a container is terminated once")
    a = settings.actuator
    details = decision.details if isinstance(decision.details, dict) else {}
    raw = details.get("grace_s")
    if raw is None:
        grace = float(a.terminate_grace_s)
    elif isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw < 0:
        return Rejected(f"terminate decision for {c!r}: details.grace_s {raw!r} is not a finite number >= 0")
    else:
        grace = float(raw)
    checkpoint = decision.is_checkpoint_stop
    what = "grace"
    if checkpoint:  # the grace began when the job was asked to checkpoint
        grace = max(0.0, min(grace, decision.ts + grace - now))
        what = "the checkpoint's remaining grace"
    notes: list[str] = []
    if grace > a.terminate_grace_max_s:
        notes.append(f"{what} {grace:g} s lowered to terminate_grace_max_s ({a.terminate_grace_max_s:g} s)")
        grace = float(a.terminate_grace_max_s)
    return Planned(Terminate(c, round(grace, 3), sigterm=not checkpoint), tuple(notes))
