"""DynamoML's job preemption, pure: workload classes, priorities, victims, freeze or stop, resume order.

:class:`PriorityPolicy` admits jobs in priority order on their host's capacity, preempts running jobs
of strictly lower priority when one does not fit (victims least important first, an irreducible set),
freezes them when the preemptor's expected holding time is short and only compute is short, else
stops them (checkpoint and exit), resumes them in priority order when capacity frees, and gives every
running job a CPU weight by priority (:func:`cpu_weight`). Time comes in as ``now``; its actions become
:class:`~phasewise.kit.records.Decision` records with :func:`to_decision`. The rules: docs/priorities.md,
"What it does".

>>> cfg = PriorityConfig(freeze_max_wait_s=60, grace_s=30, cpu_weight_ratio=None)
>>> p = PriorityPolicy(cfg, {"n1": Capacity(cpu_cores=2, mem_bytes=8e9)})
>>> [a.kind for a in p.submit(JobRequest("a", "n1", cpu_cores=1, mem_bytes=1e9), now=0)]
['start']
>>> [a.kind for a in p.submit(JobRequest("b", "n1", cpu_cores=1, mem_bytes=1e9, priority=1), now=1)]
['start']
>>> acts = p.submit(JobRequest("h", "n1", cpu_cores=1, mem_bytes=1e9, priority=5, expected_s=30), now=2)
>>> [(a.kind, a.job) for a in acts]
[('freeze', 'a'), ('start', 'h')]
>>> [(a.kind, a.job) for a in p.finish("h", now=40)]
[('thaw', 'a')]
>>> cpu_weight(0, "training"), cpu_weight(0, "inference"), cpu_weight(1, "training"), cpu_weight(20, "training")
(100, 159, 200, 10000)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from phasewise.kit.records import Decision

__all__ = [
    "ACTION_KINDS", "CLASS_RANK", "POLICY", "WEIGHT_DEFAULT", "WEIGHT_MAX", "WEIGHT_MIN", "WORKLOADS", "Action",
    "Capacity", "JobRequest", "PriorityConfig", "PriorityPolicy", "cpu_weight", "to_decision", "weight_action",
]

#: ``Decision.policy`` of this policy's decisions
POLICY = "priority"
#: workload classes, most important first (the tie-break between equal priorities)
WORKLOADS = ("inference", "interactive", "training")
CLASS_RANK = {"inference": 2, "interactive": 1, "training": 0}
#: what the policy asks for: ``start`` a new job, ``freeze`` / ``thaw`` one (cgroup freezer),
#: ``checkpoint_stop`` one (checkpoint-and-exit, then a hard stop after the grace period), ``restart`` a
#: stopped one from its checkpoint, set a job's CPU ``weight``
ACTION_KINDS = ("start", "freeze", "thaw", "checkpoint_stop", "restart", "weight")
_EPS = 1e-9
#: cgroup v2 ``cpu.weight``: its range and the default of a cgroup nobody weighted
WEIGHT_MIN, WEIGHT_MAX, WEIGHT_DEFAULT = 1, 10_000, 100


def weight_action(job: str, host: str, priority: int, workload: str, ratio: float, why: str = "") -> Action:
    """The ``weight`` action of a job of *priority* and *workload* on *host*, its rule in the reason.

    >>> weight_action("j", "h", 5, "training", 2.0, "started").reason
    'cpu weight 3200: priority 5 training (100 x 2^(5 + 0/3), within [1, 10000]); started'
    """
    w = cpu_weight(priority, workload, ratio)
    reason = (f"cpu weight {w}: priority {priority} {workload} "
              f"(100 x {ratio:g}^({priority} + {CLASS_RANK[workload]}/3), within [{WEIGHT_MIN}, {WEIGHT_MAX}])"
              + (f"; {why}" if why else ""))
    return Action("weight", job, host, reason,
                  {"cpu_weight": w, "priority": priority, "workload": workload, "ratio": ratio})


def cpu_weight(priority: int, workload: str, ratio: float = 2.0) -> int:
    """The CPU weight (cgroup v2 ``cpu.weight`` units) of a job of *priority* and *workload* class.

    ``100 x ratio ** (priority + class_rank / 3)`` rounded, within
    ``[1, 10000]`` (``cpu.weight``'s range): a priority level multiplies the
    weight by *ratio*; the class adds a third of a level per rank (training 0,
    interactive 1, inference 2), so at equal priority inference weighs
    ``ratio ** (2/3)`` times training (1.59 at ratio 2) and the weights follow
    the policy's order of importance (priority, then class): a more important
    job never weighs less than a less important one (equal only where both
    are at a bound). A training job of priority 0 weighs 100, the weight of a
    cgroup nobody set.

    Why inference above training at equal priority: a CPU slice an inference
    request waits for is added to its response time, which its SLO bounds,
    and a replica uses the CPU in short bursts (a high weight costs the
    others little on average); a training job's objective is throughput over
    hours, and a slice it waits for moves its end by that slice. Interactive
    work (a person waiting seconds) sits between them.

    >>> [cpu_weight(p, "training") for p in (-7, -1, 0, 3)]
    [1, 50, 100, 800]
    >>> cpu_weight(0, "interactive"), cpu_weight(2, "inference", ratio=1.5)
    (126, 295)
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if workload not in CLASS_RANK:
        raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {workload!r}")
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio >= 1):
        raise ValueError(f"ratio must be a finite number >= 1, got {ratio!r}")
    level = priority + CLASS_RANK[workload] / len(WORKLOADS)
    exp = level * math.log(ratio) + math.log(WEIGHT_DEFAULT)
    if exp >= math.log(WEIGHT_MAX):  # (also keeps ratio ** level from overflowing)
        return WEIGHT_MAX
    return int(min(WEIGHT_MAX, max(WEIGHT_MIN, round(math.exp(exp)))))


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """The policy's parameters.

    ``freeze_max_wait_s``: the longest expected wait for which victims are
    frozen rather than stopped (a frozen job holds its memory all that time);
    ``grace_s``: how long a checkpoint-and-exit is given before the hard stop
    (carried in the decision for the actuator); ``cpu_weight_ratio``: the
    weight factor of one priority level (:func:`cpu_weight`), ``None``: no
    ``weight`` actions. The agent builds them from its ``priority_*`` settings, which hold their
    defaults (docs/architecture.md, "Defaults").
    """

    freeze_max_wait_s: float
    grace_s: float
    cpu_weight_ratio: float | None

    def __post_init__(self) -> None:
        for name in ("freeze_max_wait_s", "grace_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"PriorityConfig.{name} must be a finite number >= 0, got {v!r}")
        r = self.cpu_weight_ratio
        if r is not None and not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
                                  and r >= 1):
            raise ValueError(f"PriorityConfig.cpu_weight_ratio must be a finite number >= 1 or None, got {r!r}")


@dataclass(frozen=True, slots=True)
class Capacity:
    """What a host offers (or a job requests): CPU cores, memory bytes, GPUs (fractions allowed)."""

    cpu_cores: float = 0.0
    mem_bytes: float = 0.0
    gpus: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cpu_cores", "mem_bytes", "gpus"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def plus(self, o: Capacity) -> Capacity:
        return Capacity(self.cpu_cores + o.cpu_cores, self.mem_bytes + o.mem_bytes, self.gpus + o.gpus)

    def minus(self, o: Capacity) -> tuple[float, float, float]:
        """Component-wise difference (may be negative)."""
        return (self.cpu_cores - o.cpu_cores, self.mem_bytes - o.mem_bytes, self.gpus - o.gpus)


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A job as the policy sees it: where it runs, what it requests, how important it is.

    ``expected_s``: how long the job is expected to hold its resources once
    started (``None``: unknown, treated as long), which decides whether its
    victims are frozen or stopped.
    """

    job: str
    host: str
    cpu_cores: float = 0.0
    mem_bytes: float = 0.0
    gpus: float = 0.0
    priority: int = 0
    workload: str = "training"
    expected_s: float | None = None

    def __post_init__(self) -> None:
        if self.workload not in CLASS_RANK:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {self.workload!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        Capacity(self.cpu_cores, self.mem_bytes, self.gpus)  # the same checks
        if self.expected_s is not None and not (math.isfinite(self.expected_s) and self.expected_s >= 0):
            raise ValueError(f"expected_s must be a finite number >= 0 or None, got {self.expected_s!r}")

    @property
    def requests(self) -> Capacity:
        return Capacity(self.cpu_cores, self.mem_bytes, self.gpus)


@dataclass(frozen=True, slots=True)
class Action:
    """One thing to do to one job, with why (``reason``) and the numbers (``details``)."""

    kind: str
    job: str
    host: str
    reason: str
    details: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Entry:
    req: JobRequest
    state: str  # pending | running | frozen | stopped
    submitted: float
    started: float | None = None
    preempted_by: str | None = None
    #: an inference service's replicas running (its actuator's ``scaled`` state): each holds its CPU and
    #: memory request; they share its GPUs, and a freeze or stop reaches the first one only
    replicas: int = 1


def _importance(e: _Entry) -> tuple:
    """Sort key, most important first."""
    return (-e.req.priority, -CLASS_RANK[e.req.workload], e.submitted, e.req.job)


def _expendability(e: _Entry) -> tuple:
    """Sort key of victims, least important first (most recently started first among equals)."""
    started = e.started if e.started is not None else -math.inf
    return (e.req.priority, CLASS_RANK[e.req.workload], -started, e.req.job)


class PriorityPolicy:
    """Admission, preemption and resume by priority over a fixed set of hosts (see the module doc)."""

    VERSION = 1

    def __init__(self, config: PriorityConfig, hosts: Mapping[str, Capacity]) -> None:
        self.config = config
        self._hosts = dict(hosts)
        self._jobs: dict[str, _Entry] = {}

    # ------------------------------------------------------------------ events

    def add_host(self, host: str, capacity: Capacity) -> None:
        """A host joins (its capacity is fixed from then on)."""
        if host in self._hosts:
            raise ValueError(f"host {host!r} is already known")
        self._hosts[host] = capacity

    def knows_host(self, host: str) -> bool:
        return host in self._hosts

    def submit(self, req: JobRequest, now: float) -> list[Action]:
        """A job arrives (an inference service's extra replica is a job of its own)."""
        if req.host not in self._hosts:
            raise KeyError(f"unknown host {req.host!r} (known: {sorted(self._hosts)})")
        if req.job in self._jobs:
            raise ValueError(f"job {req.job!r} was already submitted")
        self._jobs[req.job] = _Entry(req, "pending", now)
        return self._schedule(now)

    def finish(self, job: str, now: float) -> list[Action]:
        """A job ended (finished, failed or was cancelled): its capacity frees."""
        if self._jobs.pop(job, None) is None:
            return []
        return self._schedule(now)

    def rescale(self, job: str, replicas: int, now: float) -> list[Action]:
        """*job* (an inference service) runs *replicas* replicas now: what it holds is that many requests (its
        GPUs once); fewer free capacity, which the waiting jobs may take. More are not preempted for: they run
        already (the autoscaler started them), and only what waits is held back by them."""
        e = self._jobs.get(job)
        n = max(1, int(replicas))
        if e is None or e.replicas == n:
            return []
        fewer, e.replicas = n < e.replicas, n
        return self._schedule(now) if fewer else []

    def reprioritize(self, job: str, priority: int, now: float) -> list[Action]:
        """*job*'s priority is now *priority*: its new CPU weight (when it holds a container) and whatever the
        new order admits or preempts (rule 1 runs again). KeyError for an unknown job, ValueError for a
        priority that is not an integer."""
        e = self._jobs.get(job)
        if e is None:
            raise KeyError(f"unknown job {job!r} (no submission)")
        old = e.req.priority
        e.req = replace(e.req, priority=priority)
        actions: list[Action] = []
        if e.state in ("running", "frozen") and old != priority:
            w = self.weight_action(job, why=f"priority {old} -> {priority}")
            if w is not None:
                actions.append(w)
        return actions + self._schedule(now)

    def weight_action(self, job: str, why: str = "") -> Action | None:
        """The ``weight`` action of *job* as it is now (``None``: weights off, or no such job)."""
        e = self._jobs.get(job)
        ratio = self.config.cpu_weight_ratio
        if e is None or ratio is None:
            return None
        r = e.req
        return weight_action(r.job, r.host, r.priority, r.workload, ratio, why)

    # ------------------------------------------------------------------ views

    def state(self, job: str) -> str | None:
        """``pending | running | frozen | stopped``, or ``None`` for an unknown job."""
        e = self._jobs.get(job)
        return None if e is None else e.state

    def states(self) -> dict[str, str]:
        return {j: e.state for j, e in sorted(self._jobs.items())}

    def used(self, host: str) -> Capacity:
        """What the host's running jobs hold, plus the memory of its frozen ones."""
        cpu = mem = gpu = 0.0
        for e in self._jobs.values():
            if e.req.host != host:
                continue
            k = e.replicas
            if e.state == "running":
                cpu, mem, gpu = cpu + k * e.req.cpu_cores, mem + k * e.req.mem_bytes, gpu + e.req.gpus
            elif e.state == "frozen":
                cpu, mem = cpu + (k - 1) * e.req.cpu_cores, mem + k * e.req.mem_bytes
        return Capacity(cpu, mem, gpu)

    # ------------------------------------------------------------------ the rules

    def _need(self, e: _Entry) -> Capacity:
        """What admitting *e* takes: a frozen job already holds its memory."""
        r = e.req
        return Capacity(r.cpu_cores, 0.0, r.gpus) if e.state == "frozen" else r.requests

    def _shortfall(self, e: _Entry) -> tuple[float, float, float]:
        free = self._hosts[e.req.host].minus(self.used(e.req.host))
        need = self._need(e)
        return (need.cpu_cores - free[0], need.mem_bytes - free[1], need.gpus - free[2])

    def _schedule(self, now: float) -> list[Action]:
        actions: list[Action] = []
        waiting = sorted((e for e in self._jobs.values() if e.state in ("pending", "frozen", "stopped")),
                         key=_importance)
        blocked: set[str] = set()  # hosts where a more important job waits: nothing below it goes first
        for e in waiting:
            host = e.req.host
            if host in blocked:
                continue
            short = self._shortfall(e)
            if max(short) > _EPS:
                victims = self._victims(e, short)
                if victims is None:
                    blocked.add(host)
                    continue
                mode, why = self._mode(e, short)
                for v in victims:
                    actions.append(self._preempt(v, e, mode, why, now))
            admit = self._admit(e, now)
            actions.append(admit)
            if admit.kind in ("start", "restart"):  # a new process: its weight (a thawed one kept its own)
                w = self.weight_action(e.req.job, why=f"{admit.kind}ed")
                if w is not None:
                    actions.append(w)
        return actions

    def _victims(self, e: _Entry, short: tuple[float, float, float]) -> list[_Entry] | None:
        """An irreducible set of strictly less important running jobs on *e*'s host covering *short*."""
        cands = sorted((v for v in self._jobs.values()
                        if v.req.host == e.req.host and v.state == "running" and v.req.priority < e.req.priority),
                       key=_expendability)
        freeze, _ = self._mode(e, short)

        def frees(v: _Entry) -> tuple[float, float, float]:
            return (v.req.cpu_cores, 0.0 if freeze == "freeze" else v.req.mem_bytes, v.req.gpus)

        def covers(vs: Iterable[_Entry]) -> bool:
            tot = [0.0, 0.0, 0.0]
            for v in vs:
                tot = [a + b for a, b in zip(tot, frees(v))]
            return all(t + _EPS >= s for t, s in zip(tot, short))

        taken: list[_Entry] = []
        for v in cands:
            if covers(taken):
                break
            taken.append(v)
        if not covers(taken):
            return None
        for v in sorted(taken, key=_expendability, reverse=True):  # spare the most important first
            rest = [t for t in taken if t is not v]
            if covers(rest):
                taken = rest
        return sorted(taken, key=_expendability)

    def _mode(self, e: _Entry, short: tuple[float, float, float]) -> tuple[str, str]:
        wait, lim = e.req.expected_s, self.config.freeze_max_wait_s
        if short[1] > _EPS:
            return "checkpoint_stop", "the preemptor needs memory, which freezing does not free"
        if wait is None:
            return "checkpoint_stop", f"{e.req.job}'s holding time is unknown (freeze only for waits <= {lim:g} s)"
        if wait > lim:
            return "checkpoint_stop", f"expected wait {wait:g} s > {lim:g} s (freeze_max_wait_s)"
        return "freeze", f"expected wait {wait:g} s <= {lim:g} s (freeze_max_wait_s)"

    def _preempt(self, v: _Entry, by: _Entry, mode: str, why: str, now: float) -> Action:
        v.state = "frozen" if mode == "freeze" else "stopped"
        v.preempted_by = by.req.job
        details = {"preemptor": by.req.job, "preemptor_priority": by.req.priority,
                   "preemptor_workload": by.req.workload, "priority": v.req.priority,
                   "workload": v.req.workload, "expected_wait_s": by.req.expected_s,
                   "freed": {"cpu_cores": v.req.cpu_cores, "gpus": v.req.gpus,
                             "mem_bytes": 0.0 if mode == "freeze" else v.req.mem_bytes}}
        if mode == "checkpoint_stop":
            details["grace_s"] = self.config.grace_s
        reason = (f"preempted by {by.req.job} (priority {by.req.priority} {by.req.workload} > "
                  f"{v.req.priority} {v.req.workload}): {mode.replace('_', '-')}, {why}")
        return Action(mode, v.req.job, v.req.host, reason, details)

    def _admit(self, e: _Entry, now: float) -> Action:
        kind = {"pending": "start", "frozen": "thaw", "stopped": "restart"}[e.state]
        was = e.preempted_by
        e.state, e.preempted_by = "running", None
        if kind == "start":
            e.started = now
        free = self._hosts[e.req.host].minus(self.used(e.req.host))
        reason = {"start": f"admitted: priority {e.req.priority} {e.req.workload} fits on {e.req.host}",
                  "thaw": f"capacity freed (preempted by {was}): thawed in priority order",
                  "restart": f"capacity freed (preempted by {was}): restarted from its checkpoint "
                             f"in priority order"}[kind]
        return Action(kind, e.req.job, e.req.host, reason,
                      {"priority": e.req.priority, "workload": e.req.workload,
                       "requests": asdict(e.req.requests), "free_after": list(free)})

    # ------------------------------------------------------------------ state

    def job_state(self, job: str) -> dict[str, Any] | None:
        """One job's part of the state (``None``: not known), for a store keyed by job."""
        e = self._jobs.get(job)
        if e is None:
            return None
        return {"v": self.VERSION, "req": asdict(e.req), "state": e.state, "submitted": e.submitted,
                "started": e.started, "preempted_by": e.preempted_by, "replicas": e.replicas}

    def load_job(self, state: Mapping) -> str:
        """Take back one job from :meth:`job_state` (its host must be known); returns the job id.

        ValueError (KeyError, TypeError) for a state this version cannot read.
        """
        if state.get("v", self.VERSION) != self.VERSION:
            raise ValueError(f"PriorityPolicy job state version {state.get('v')!r} is not {self.VERSION}")
        req = JobRequest(**state["req"])
        if req.host not in self._hosts:
            raise KeyError(f"unknown host {req.host!r}")
        if state["state"] not in ("pending", "running", "frozen", "stopped"):
            raise ValueError(f"job state {state['state']!r} is not pending, running, frozen or stopped")
        self._jobs[req.job] = _Entry(req, state["state"], float(state["submitted"]), state["started"],
                                     state["preempted_by"], max(1, int(state.get("replicas", 1))))
        return req.job

    def to_state(self) -> dict[str, Any]:
        return {"v": self.VERSION, "jobs": [self.job_state(j) for j in self._jobs]}

    @classmethod
    def from_state(cls, config: PriorityConfig, hosts: Mapping[str, Capacity], state: Mapping) -> PriorityPolicy:
        if state.get("v") != cls.VERSION:
            raise ValueError(f"PriorityPolicy state version {state.get('v')!r} is not {cls.VERSION}")
        p = cls(config, hosts)
        for j in state["jobs"]:
            p.load_job(j)
        return p


#: ``Decision.action`` of each action kind; start and restart are placements (the job runs on ``host``)
_DECISION_ACTION = {"start": "place", "restart": "place", "freeze": "freeze", "thaw": "thaw",
                    "checkpoint_stop": "terminate", "weight": "weight"}


def to_decision(action: Action, ts: float, container: str | None = None) -> Decision:
    """The decision record of *action* (idempotency key: a hash of kind, host, job, time and a weight's value).

    *container*: the job's container when it is not named after the job.

    ``checkpoint_stop`` is a ``terminate`` with ``details["mode"] = "checkpoint"``
    (graceful: checkpoint-and-exit through the control channel, a hard stop
    after ``details["grace_s"]``); ``restart`` a ``place`` with
    ``details["resume"] = True``.

    >>> a = Action("freeze", "job-a", "n1", "preempted by h", {"preemptor": "h"})
    >>> d = to_decision(a, 10.0)
    >>> d.action, d.container, d.policy, d.details["kind"]
    ('freeze', 'job-a', 'priority', 'freeze')
    """
    details = {**action.details, "kind": action.kind}
    if action.kind == "checkpoint_stop":
        details["mode"] = "checkpoint"
    if action.kind in ("start", "restart"):
        details["resume"] = action.kind == "restart"
        details["policy"] = POLICY
    raw = f"{POLICY}|{action.kind}|{action.host}|{action.job}|{ts!r}"
    if action.kind == "weight":
        raw += f"|{action.details.get('cpu_weight')}"
    return Decision(id=hashlib.blake2b(raw.encode(), digest_size=12).hexdigest(), ts=ts, host=action.host,
                    container=container or action.job, action=_DECISION_ACTION[action.kind], policy=POLICY,
                    reason=action.reason, details=details)
