"""The priority agent's step: one job event in; place, freeze, thaw, terminate and weight decisions,
checkpoint controls and admission hints out.

:class:`PriorityStep` decodes a record of the job-events topic, hands what it means to the
:class:`~phasewise.models.jobs.priorities.PriorityPolicy` (DynamoML's preemption, CPU weights) and
returns the :class:`~phasewise.kit.records.Decision` and :class:`~phasewise.kit.records.JobControl`
records it causes; with ``launcher = place`` a start is an ``admitted`` hint instead, and with either launcher
a checkpoint stop is also a ``stopped`` hint (:meth:`take_hints`).
A record it cannot take raises :class:`~phasewise.kit.records.SchemaError` or a
:class:`~phasewise.models.jobs.events.Refused`. It keeps each job's state for the changelogged table
(:meth:`writes`, :meth:`restore`). Narrative: docs/priorities.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import TERMINAL_KINDS, Decision, JobControl, JobEvent, decode
from phasewise.models.jobs.events import EventTimeRefused, JobPositions, Refused, SignatureRefused
from phasewise.models.jobs.lifecycle import STOP_EXITS, Lifecycle, submission_problem
from phasewise.models.jobs.priorities import Action, Capacity, JobRequest, PriorityConfig, PriorityPolicy, to_decision
from phasewise.models.jobs.submissions import Submissions
from phasewise.models.safety.intake import EventClock

__all__ = ["ACTS_ON", "HINT_STEP_S", "LAUNCHERS", "EventTimeRefused", "PriorityStep", "PriorityStepConfig",
           "Refused", "SignatureRefused"]

log = logging.getLogger(__name__)

#: the job-event kinds the agent acts on; the others (progress, its own hints) are skipped
ACTS_ON = frozenset({"submitted", "started", "scaled", "priority", "terminated"} | TERMINAL_KINDS)
#: the states only a role holding the cluster key writes (the actuator's, the placement agent's lost)
SIGNED_KINDS = frozenset({"started", "scaled", "terminated"} | TERMINAL_KINDS)
#: who starts an admitted job: this agent (its own ``place`` decision) or the placement agent (a hint)
LAUNCHERS = ("self", "place")


#: the least time between two hints of one job (they are strictly ordered)
HINT_STEP_S = 0.001


@dataclass(frozen=True)
class PriorityStepConfig:
    """The priority agent's parameters (:func:`phasewise.streams.config.priority_step_config` maps the
    ``priority_*`` settings onto them)."""

    #: the policy's rule: freeze wait, grace, CPU weights
    policy: PriorityConfig
    #: every host's capacity
    capacity: Capacity
    #: the host of a job whose submitted event names none (this worker's ``host``)
    default_host: str
    #: the job-events topic's partition count (a job's state goes to the changelog partition of its events)
    partitions: int
    #: who starts an admitted job (:data:`LAUNCHERS`): ``self`` (its ``place`` decision) or ``place`` (a hint)
    launcher: str
    #: ``self`` launcher: seconds after a start or restart decision a job has to be reported ``started``
    #: before it is released as ``lost`` (0: never; ``place`` launcher: the placement agent's timeout)
    start_timeout_s: float

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {self.launcher!r}")


class PriorityStep:
    """Raw job-event records -> decisions and control records (the agent without Faust), and its state.

    *submissions*: the start details a ``place`` decision copies from a job's ``submitted`` event, and the
    trusted submitters' check. *clock*, *now*: the event-time rule per job and the worker's clock
    (``None``: no rule, as for replays of recorded events). *verify*: the cluster key's check of a
    job-events record ``(key, value, headers) -> why not``, ``None``: no key; a ``started`` event's
    container is taken only from a record it passes (the actuator's).
    """

    def __init__(self, config: PriorityStepConfig, submissions: Submissions, *, clock: EventClock | None = None,
                 now: Callable[[], float] | None = None,
                 verify: Callable[[bytes | None, bytes | None, Any], str | None] | None = None) -> None:
        if clock is not None and now is None:
            raise ValueError("an event-time rule needs the worker's clock (now)")
        self.config = config
        self.launcher = config.launcher
        self.verify = verify
        #: a job no trusted submitter signed books nothing and preempts nobody
        self.submissions = submissions
        #: the hints (job events) the records handled since the last :meth:`take_hints` caused
        self.hints: list[JobEvent] = []
        self.policy = PriorityPolicy(config.policy, {})
        self.clock = clock
        self.now = now
        self.capacity = config.capacity
        self.default_host = config.default_host
        #: job -> what the policy does not hold: {"sub": its start details, "gpu": requests GPUs, "ctr": container}
        self.jobs: dict[str, dict[str, Any]] = {}
        #: each job's changelog partition and the last of its events the state holds
        self.positions = JobPositions(config.partitions)
        self._dirty: set[str] = set()
        self.replayed = 0
        #: the jobs seen ending, and the states ignored (counted by the agent)
        self.lifecycle = Lifecycle("priorities")

    # ------------------------------------------------------------------ one record

    def handle(self, raw: bytes | None, partition: int | None = None, offset: int | None = None, *,
               key: bytes | None = None, headers: Any = None) -> tuple[list[Decision], list[JobControl]]:
        """What one record causes; raises :class:`SchemaError` or :class:`Refused` for a dead letter.

        *key*, *headers*: the record's, for the cluster key's check of a ``started`` event.
        The hints it causes go to :attr:`hints`.
        """
        ev = decode(JobEvent, raw)
        if ev.kind not in ACTS_ON:
            return [], []
        if ev.kind in SIGNED_KINDS and self.verify is not None and ev.job in self.jobs:
            why = self.verify(key, raw, headers)
            if why is not None:  # only the actuator that ran the job says where it runs and that it ended
                what = "its container is not taken" if ev.kind == "started" else "it frees nothing"
                raise SignatureRefused(f"JobEvent {ev.kind} {ev.job}: not signed by the cluster key ({why}): {what}")
        known = self.policy.state(ev.job) is not None
        if self.positions.seen(ev.job, partition, offset):
            self.replayed += 1  # its effect is in the restored state already
            return [], []
        if self.clock is not None and (why := self.clock.admit(ev.job, ev.ts, now=self.now())) is not None:
            raise EventTimeRefused(f"JobEvent {ev.kind} {ev.job}: {why}")
        if ev.kind == "submitted":
            actions = self._submitted(ev)
        elif ev.kind == "started":
            actions = self._started(ev)
        elif ev.kind == "scaled":
            actions = self._scaled(ev)
        elif ev.kind == "priority":
            if self.policy.state(ev.job) is None:
                raise Refused(f"JobEvent: priority of unknown job {ev.job!r} (no submitted event)")
            actions = self.policy.reprioritize(ev.job, ev.priority, now=ev.ts)
        else:  # a state that ends it
            actions = self._ended(ev)
        if self.policy.state(ev.job) is not None:
            self.positions.note(ev.job, partition, offset)
            self._dirty.add(ev.job)
        elif known:
            self._dirty.add(ev.job)  # gone: its key is deleted
        self._dirty.update(a.job for a in actions)
        decisions, hints = [], []
        hinted_starts = set()
        for a in actions:
            self._note(a, ev.ts)
            # a checkpoint stop is a state of the job whoever launches it (the targets agent keeps following a
            # job whose exit it sees after it); starts and restarts are hints only for the placement agent
            if a.kind == "checkpoint_stop" or (self.launcher == "place" and a.kind in ("start", "restart")):
                hints.append(self._hint(a, ev.ts))
                if a.kind != "checkpoint_stop":
                    hinted_starts.add(a.job)
                    continue  # the placement agent places it
            if a.kind == "weight" and a.job in hinted_starts:
                self._weighed(a)
                continue  # no container yet: the placement agent sends it with its place decision
            decisions.append(self._decision(a, ev.ts))
        controls = [self._control(d, ev.ts) for d in decisions if d.action == "terminate"]
        self.hints += hints
        return decisions, controls

    def _submitted(self, ev: JobEvent) -> list[Action]:
        if ev.spec is None:
            raise Refused(f"JobEvent: submitted job {ev.job!r} carries no spec (requests)")
        if self.submissions.check is not None:
            why = self.submissions.check(ev)
            if why is not None:
                raise SignatureRefused(f"JobEvent: submitted job {ev.job!r} refused: {why}")
        host = ev.host or self.default_host
        if self.policy.state(ev.job) is not None:
            raise Refused(f"JobEvent: job id {ev.job!r} already submitted: this submission is refused; submit it "
                          f"under another id", "duplicate")
        ended = self.lifecycle.ended_as(ev.job)
        if ended is not None and ended[2] != ev.ts:
            raise Refused(f"JobEvent: job id {ev.job!r} already submitted (it ended: {ended[0]} at {ended[1]:.3f}): "
                          f"this submission is refused; submit it under another id", "duplicate")
        if ended is not None:
            return []  # its submission read again after it ended: not admitted a second time
        if (why := submission_problem(ev)) is not None:
            raise Refused(why)
        r = ev.spec.requests
        try:
            req = JobRequest(ev.job, host, cpu_cores=r.cpu_cores or 0.0, mem_bytes=r.mem_bytes or 0.0,
                             gpus=r.gpus, priority=ev.priority, workload=ev.workload,
                             expected_s=ev.spec.expected_s)
        except ValueError as e:
            raise Refused(f"JobEvent: job {ev.job!r}: {e}") from None
        if not self.policy.knows_host(host):
            self.policy.add_host(host, self.capacity)
        # the submitter's container is not taken: a job's container is its id until an actuator says otherwise
        self.jobs[ev.job] = {"sub": self.submissions.details(ev), "gpu": r.gpus > 0, "ctr": ev.job, "sts": ev.ts}
        return self.policy.submit(req, now=ev.ts)

    def _started(self, ev: JobEvent) -> list[Action]:
        info = self.jobs.get(ev.job)
        if info is None:  # a job submitted before this agent, or never, or ended: not the policy's
            if (why := self.lifecycle.unheld(ev.job, ev.kind, ev.ts)) is not None:
                self.lifecycle.ignore(ev.job, ev.kind, why)
            return []
        if ev.container:
            info["ctr"] = ev.container
        info.pop("start_by", None)  # alive
        info.pop("stopping", None)  # a terminated from now on ends this run
        info["up"] = True  # (a rejected from now on is of an older decision)
        if self.policy.state(ev.job) != "running":
            return []
        w = self.policy.weight_action(ev.job, why="started")
        if w is None or info.get("w") == w.details["cpu_weight"]:
            return []  # its weight went with (or right after) the decision that started it
        return [w]

    def _scaled(self, ev: JobEvent) -> list[Action]:
        """An inference service's local replicas running now: the policy counts each one's request on its host
        (a Deployment's pods, no host: placed by Kubernetes, not counted)."""
        if ev.job not in self.jobs:
            if (why := self.lifecycle.unheld(ev.job, ev.kind, ev.ts)) is not None:
                self.lifecycle.ignore(ev.job, ev.kind, why)
            return []
        if ev.replicas is None or not ev.host:
            return []
        return self.policy.rescale(ev.job, ev.replicas, now=ev.ts)

    def _ended(self, ev: JobEvent) -> list[Action]:
        """A state that ends *ev.job* (:data:`~phasewise.kit.records.TERMINAL_KINDS`), unless it is the exit of
        this agent's own checkpoint stop (any of :data:`STOP_EXITS` while that stop is pending): it leaves the
        policy, whose capacity it held frees."""
        info = self.jobs.get(ev.job)
        if self.policy.state(ev.job) is None:
            if (why := self.lifecycle.unheld(ev.job, ev.kind, ev.ts)) is not None:
                self.lifecycle.ignore(ev.job, ev.kind, why)
            return []
        if ev.kind in STOP_EXITS and info is not None and info.pop("stopping", None):
            # the exit its own checkpoint stop asked for: it is restarted in priority order (a job whose work was
            # in fact done ends again at once when it resumes from its checkpoint)
            if ev.kind != "terminated":
                log.info("priorities: job %s %s during its checkpoint stop: taken as the stop's exit, resumed in "
                         "priority order", ev.job, ev.kind)
            return []
        if ev.kind == "rejected" and info is not None and info.get("up"):
            self.lifecycle.ignore(ev.job, ev.kind, "after_start", ev.reason or "")
            return []
        self.lifecycle.end(ev.job, ev.kind, ev.ts, (info or {}).get("sts"))
        self.jobs.pop(ev.job, None)
        return self.policy.finish(ev.job, now=ev.ts)

    def _note(self, a: Action, ts: float) -> None:
        """What the step remembers of an action: a stop's exit to come, a start's lost deadline."""
        info = self.jobs.get(a.job)
        if info is None:
            return
        if a.kind == "checkpoint_stop":
            info["stopping"] = True  # its process exits: that terminated is this stop's
            info.pop("start_by", None)
            info.pop("up", None)
        elif a.kind in ("start", "restart") and self.launcher == "self" and self.config.start_timeout_s > 0:
            # from the decision's time: its event's, or the worker's clock where that is later (an event
            # stamped long ago, read late, does not make its job lost at once)
            at = ts if self.now is None else max(ts, self.now())
            info["start_by"] = at + self.config.start_timeout_s

    def expire(self, now: float) -> tuple[list[Decision], list[JobControl], list[JobEvent]]:
        """Jobs this agent started (``self`` launcher) that no ``started`` event reached within
        ``job_start_timeout_s`` of their start decision, by event time *now*: each leaves the policy as
        ``lost``; the decisions and controls that frees, and the lost events to publish."""
        lost_events: list[JobEvent] = []
        actions: list[Action] = []
        for job, info in sorted(self.jobs.items()):
            t = info.get("start_by")
            if t is None or t > now or self.policy.state(job) != "running":
                continue
            st = self.policy.job_state(job) or {}
            host = (st.get("req") or {}).get("host") or self.default_host
            reason = (f"no sign of life: no started event within job_start_timeout_s "
                      f"{self.config.start_timeout_s:g} s of its start decision on {host}; what it held is freed")
            log.warning("priorities: job %s lost: %s", job, reason)
            req = st.get("req") or {}
            lost_events.append(JobEvent(job=job, ts=now, kind="lost", host=host, container=info.get("ctr") or job,
                                        reason=reason, workload=req.get("workload", "training"),
                                        priority=int(req.get("priority", 0))))
            self.lifecycle.end(job, "lost", now, info.get("sts"))
            self.jobs.pop(job, None)
            self._dirty.add(job)
            actions += self.policy.finish(job, now=now)
        self._dirty.update(a.job for a in actions)
        decisions = []
        for a in actions:
            self._note(a, now)
            decisions.append(self._decision(a, now))
        controls = [self._control(d, now) for d in decisions if d.action == "terminate"]
        return decisions, controls, lost_events

    def _control(self, d: Decision, ts: float) -> JobControl:
        return JobControl(id=hashlib.blake2b(f"priority|{d.id}".encode(), digest_size=12).hexdigest(),
                          job=d.details.get("job", d.container), ts=ts, action="checkpoint_exit", policy="priority",
                          reason=d.reason, grace_s=d.details.get("grace_s"))

    def _weighed(self, a: Action) -> None:
        """Remember the CPU weight sent for *a*'s job, so that its ``started`` event does not send it again."""
        info = self.jobs.get(a.job)
        if info is not None:
            info["w"] = a.details["cpu_weight"]

    def take_hints(self) -> list[JobEvent]:
        """The hints caused since the last call (``admitted`` with ``launcher = place``, ``stopped`` with either),
        in order; cleared."""
        out, self.hints = self.hints, []
        return out

    def _hint(self, a: Action, ts: float) -> JobEvent:
        """The ``admitted`` (start, restart) or ``stopped`` (checkpoint_stop) job event of *a*."""
        info = self.jobs.setdefault(a.job, {})
        prev = info.get("hts")
        # a job's hints are strictly ordered in time: the placement agent tells a stale stopped hint
        # (one sent again by a worker restarted before its commit) from the admission that followed it
        ts = ts if prev is None else max(ts, float(prev) + HINT_STEP_S)
        info["hts"] = ts
        if a.kind == "checkpoint_stop":
            return JobEvent(job=a.job, ts=ts, kind="stopped", host=a.host, container=info.get("ctr") or a.job,
                            priority=a.details["priority"], workload=a.details["workload"])
        return JobEvent(job=a.job, ts=ts, kind="admitted", host=a.host, container=info.get("ctr") or a.job,
                        priority=a.details["priority"], workload=a.details["workload"],
                        resume=a.kind == "restart")

    def _decision(self, a: Action, ts: float) -> Decision:
        if a.kind == "weight":
            self._weighed(a)
        info = self.jobs.get(a.job, {})
        ctr = info.get("ctr") or a.job
        extra: dict[str, Any] = {}
        if a.kind in ("start", "restart"):
            # who runs is decided here, not on which CPUs or GPUs: the actuator binds the job to its host's
            # CPUs (a resumed job keeps its container's cpuset); a job that requests GPUs sees what the
            # actuator sees, others none. What runs is the submitted spec's command, if its signature
            # verifies at the actuator: copied from the submitted event, never written here
            extra = {**info.get("sub", {}), "cpuset": None, "device": None if info.get("gpu") else []}
            if "priority" in extra and extra["priority"] != a.details.get("priority"):
                extra["admitted_priority"] = a.details.get("priority")
        if ctr != a.job:
            extra["job"] = a.job
        if extra:
            a = Action(a.kind, a.job, a.host, a.reason, {**a.details, **extra})
        return to_decision(a, ts, container=ctr)

    # ------------------------------------------------------------------ state

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the jobs changed since the last call."""
        out = []
        for job in sorted(self._dirty):
            st = self.policy.job_state(job)
            p = self.positions.partition(job)
            if st is None:
                out.append((job, p, None))
                self.positions.forget(job)
                self.jobs.pop(job, None)
                continue
            value = {"p": p, "o": self.positions.offset(job), "s": st, "job": self.jobs.get(job, {})}
            out.append((job, p, json.dumps(value, separators=(",", ":")).encode()))
        self._dirty.clear()
        return out

    def restore(self, items: Any) -> int:
        """The policy again from the table's ``(key, value)`` items; how many jobs."""
        self.policy = PriorityPolicy(self.config.policy, {})
        self.jobs.clear()
        self.positions.clear()
        self._dirty.clear()
        n = 0
        for job, raw in items:
            if raw is None:
                continue
            try:
                v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
                host = v["s"]["req"]["host"]
                if not self.policy.knows_host(host):
                    self.policy.add_host(host, self.capacity)
                self.policy.load_job(v["s"])
                self.jobs[job] = dict(v.get("job") or {})
                self.positions.load(job, v["p"], v.get("o"))
                n += 1
            except (ValueError, KeyError, TypeError) as e:  # a state this version cannot read
                log.error("priorities: cannot restore job %s (%s); it is known again from its next submitted "
                          "event", job, e)
        return n
