"""The priority agent (``phasewise worker --priorities``): job events in; place, freeze, thaw, terminate, weight out.

For every record on the job-events topic (key: job):

- decode it as a :class:`~phasewise.kit.records.JobEvent`; what does not decode
  (a null value, bytes that are not JSON, nesting too deep, wrong types,
  another schema version) is a dead letter with the parser's reason, and the
  agent carries on;
- ``submitted``: the job (its ``spec.requests``, ``priority``, ``workload``,
  ``spec.expected_s``, on its ``host`` or this worker's ``--host``) goes to
  :class:`~phasewise.models.jobs.priorities.PriorityPolicy`, and what the actuator
  needs to verify its start (:func:`phasewise.kit.job_signing.start_details`: the
  spec, its digest, the submitter's signature) is kept for its ``place``
  decisions; its ``container`` is ignored (a job's container is named after
  it until a ``started`` event says otherwise); a submission the policy
  refuses (no spec, a job id submitted twice) is a dead letter with the
  reason, and the policy is unchanged; so is, where the worker has
  ``job_trusted_submitters``, a submission no trusted submitter signed (a
  stranger's job books no capacity and preempts nobody);
- ``started``: the job runs in ``container`` (later decisions name it); a
  running job gets its CPU weight there. With a cluster key
  (``signing_key_file``) only a ``started`` event signed with it (the
  actuator's) is taken; another is a dead letter;
- ``priority``: the job's priority is now ``priority``: its new CPU weight,
  and whatever the new order admits or preempts; an unknown job is a dead
  letter;
- ``finished``: the job's capacity frees, and waiting jobs are thawed,
  restarted or started in priority order;
- ``progress`` records, and the ``admitted`` and ``stopped`` hints this agent
  publishes itself, are not its concern: skipped before anything is checked,
  never dead-lettered.

Each action becomes a :class:`~phasewise.kit.records.Decision` (``policy="priority"``,
keyed by host): ``place`` for a start or a restart (``details.resume``), with
the submitted event's job, time, workload, priority, spec, spec digest and
signature (the actuator runs the spec's command only if a trusted submitter
signed it; the agent never writes a command), the priority it was admitted
at (``admitted_priority``) where that differs, no cpuset (the actuator binds
it to its host's CPUs; a resumed job keeps its container's) and no GPUs
(``device`` []), or GPUs not named (``null``) for a job that requests some; ``freeze`` /
``thaw`` for the cgroup freezer; ``terminate`` with ``details.mode =
"checkpoint"`` for checkpoint-and-stop, which also sends a
:class:`~phasewise.kit.records.JobControl` ``checkpoint_exit`` (with the grace
period) to the control topic keyed by job, for the job's progress reporter;
``weight`` (``details.cpu_weight``) when a job starts or restarts and when its
priority changes (``priority_cpu_weights``). Everything goes through the
worker's output producer, so an offset is committed only after what its record
caused was delivered. An output the producer or the broker refuses for itself
(too large) makes the event that caused it a dead letter (kind
``output_refused``) and the agent goes on; the job events' bounds (docs/security.md,
"Record sizes") keep that from happening.

With ``priority_launcher = place`` the agent decides when, the placement agent
(``phasewise place --place-after-admission``) where: instead of its own
``place`` decision for a start or a restart it publishes a
:class:`~phasewise.kit.records.JobEvent` hint of kind ``admitted`` on the job-events
topic (key: job) with the host it admitted the job on, its priority, workload,
container and ``resume`` (a restart from its checkpoint), and for a
checkpoint-and-stop, besides the ``terminate`` decision and the control, one of
kind ``stopped`` (the job holds nothing now; a frozen job keeps its booking).
A hint is stamped with the time of the event that caused it, and always after
the job's previous hint (by at least :data:`HINT_STEP_S`). The ``freeze``,
``thaw`` and ``terminate`` decisions are the same in both modes, and so are the
weights of a priority change or a ``started`` event; the weight of a start or
restart is the placement agent's to send, after its ``place`` decision (the job
has no container before it). The hints are signed with the cluster key, like the
decisions.

State: the changelogged table ``priority-state`` (key: job) holds each job's
entry of the policy (request, state, times, its preemptor), its submission
(spec, digest, signature), its container and the offset of the last of its events the state holds; written at
the worker's offset commits through the commit barrier (the decisions first
delivered), restored when the worker starts or takes its partitions back. A
job's state goes to the changelog partition of its job events: a worker that
died after a commit wrote the table but before it committed the offsets reads
those events again, and skips them. The agent holds every host's view: run one
worker with ``--priorities``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from phasewise.kit.job_signing import SubmitterKeys, start_details, trusted_submitters
from phasewise.kit.records import Decision, JobControl, JobEvent, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, DECISIONS, JOB_EVENTS
from phasewise.models.jobs.priorities import Action, Capacity, JobRequest, PriorityConfig, PriorityPolicy, to_decision
from phasewise.models.safety.intake import EventClock

__all__ = ["ACTS_ON", "LAUNCHERS", "TABLE_NAME", "EventTimeRefused", "PriorityStep", "Refused", "SignatureRefused",
           "priority_config", "register_priorities"]

log = logging.getLogger(__name__)

TABLE_NAME = "priority-state"
#: the job-event kinds the agent acts on; the others (progress, its own hints) are skipped
ACTS_ON = frozenset({"submitted", "started", "priority", "finished"})
#: who starts an admitted job: this agent (its own ``place`` decision) or the placement agent (a hint)
LAUNCHERS = ("self", "place")


#: the least time between two hints of one job (they are strictly ordered)
HINT_STEP_S = 0.001


class Refused(ValueError):
    """A valid record the policy cannot take (``str(e)`` is the reason for its dead letter)."""


class SignatureRefused(Refused):
    """A record that must be signed and is not: a ``started`` event without the cluster key's signature, a
    submission no trusted submitter signed (where the agent has ``job_trusted_submitters``)."""


class EventTimeRefused(Refused):
    """A job event stamped beyond the clock's allowance or far behind the job's newest event."""


def priority_config(settings: Settings) -> tuple[PriorityConfig, Capacity]:
    """The policy's parameters and every host's capacity from settings (0 = this host's cores / memory)."""
    p = settings.priority
    cpu = p.host_cpu_cores or float(os.cpu_count() or 1)
    mem = float(p.host_mem_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return (PriorityConfig(freeze_max_wait_s=p.freeze_max_wait_s, grace_s=p.grace_s,
                           cpu_weight_ratio=p.cpu_weight_ratio if p.cpu_weights else None),
            Capacity(cpu, mem, p.host_gpus))


class PriorityStep:
    """Raw job-event records -> decisions and control records (the agent without Faust), and its state.

    *partitions*: the job-events topic's partition count (a job's state goes to
    the changelog partition of its events; a job restored without events yet,
    to its stored one). *launcher*: ``self`` (start and restart are ``place``
    decisions) or ``place`` (they are ``admitted`` hints, a checkpoint-and-stop
    also a ``stopped`` one: :meth:`take_hints`).
    """

    def __init__(self, config: PriorityConfig, capacity: Capacity, default_host: str, *,
                 partitions: int = JOB_EVENTS.partitions, clock: EventClock | None = None,
                 now: Callable[[], float] = time.time, launcher: str = "self",
                 verify: Callable[[str, bytes | None, bytes | None, Any], str | None] | None = None,
                 submitters: SubmitterKeys | None = None) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {list(LAUNCHERS)}, got {launcher!r}")
        self.launcher = launcher
        #: the cluster key's check of a record (``Keyring.verify``; ``None``: no key): a ``started``
        #: event's container is taken only from a record it passes
        self.verify = verify
        #: the submitters whose jobs it takes (``job_trusted_submitters``; ``None``: every job): a job no trusted
        #: submitter signed books nothing and preempts nobody
        self.submitters = submitters
        #: the hints (job events) the records handled since the last :meth:`take_hints` caused
        self.hints: list[JobEvent] = []
        self.policy = PriorityPolicy(config, {})
        #: the event-time rule per job (``None``: none, as for replays of recorded events)
        self.clock = clock
        self.now = now
        self.config = config
        self.capacity = capacity
        self.default_host = default_host
        self.partitions = partitions
        #: job -> what the policy does not hold: {"sub": its start details (job_signing.start_details),
        #: "gpu": requests GPUs, "ctr": container}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.partition_of: dict[str, int] = {}
        #: job -> offset of the last of its events the state holds (in its partition): an event at or
        #: before it, read again after a restart whose last offsets were not committed, is not applied twice
        self.offset_of: dict[str, int] = {}
        self._dirty: set[str] = set()
        self.replayed = 0

    # ------------------------------------------------------------------ one record

    def handle(self, raw: bytes | None, partition: int | None = None, offset: int | None = None, *,
               key: bytes | None = None, headers: Any = None) -> tuple[list[Decision], list[JobControl]]:
        """What one record causes; raises :class:`SchemaError` or :class:`Refused` for a dead letter.

        *key*, *headers*: the record's, for the cluster key's check of a ``started`` event.
        With ``launcher = place`` the hints it causes go to :attr:`hints`.
        """
        ev = decode(JobEvent, raw)
        if ev.kind not in ACTS_ON:
            return [], []
        if ev.kind == "started" and self.verify is not None and ev.job in self.jobs:
            why = self.verify(JOB_EVENTS.name, key, raw, headers)
            if why is not None:  # only the actuator that started the job says where it runs
                raise SignatureRefused(f"JobEvent started {ev.job}: not signed by the cluster key ({why}): its "
                                       f"container is not taken")
        known = self.policy.state(ev.job) is not None
        seen = self.offset_of.get(ev.job)
        if (seen is not None and offset is not None and offset <= seen
                and self.partition_of.get(ev.job) == partition):
            self.replayed += 1  # its effect is in the restored state already
            return [], []
        if self.clock is not None and (why := self.clock.admit(ev.job, ev.ts, now=self.now())) is not None:
            raise EventTimeRefused(f"JobEvent {ev.kind} {ev.job}: {why}")
        if ev.kind == "submitted":
            actions = self._submitted(ev)
        elif ev.kind == "started":
            actions = self._started(ev)
        elif ev.kind == "priority":
            if self.policy.state(ev.job) is None:
                raise Refused(f"JobEvent: priority of unknown job {ev.job!r} (no submitted event)")
            actions = self.policy.reprioritize(ev.job, ev.priority, now=ev.ts)
        else:  # finished
            actions = self.policy.finish(ev.job, now=ev.ts)
            self.jobs.pop(ev.job, None)
        if self.policy.state(ev.job) is not None:
            if partition is not None:
                self.partition_of[ev.job] = partition
            if offset is not None:
                self.offset_of[ev.job] = offset
            self._dirty.add(ev.job)
        elif known:
            self._dirty.add(ev.job)  # gone: its key is deleted
        self._dirty.update(a.job for a in actions)
        decisions, hints = [], []
        hinted_starts = set()
        for a in actions:
            if self.launcher == "place" and a.kind in ("start", "restart", "checkpoint_stop"):
                hints.append(self._hint(a, ev.ts))
                if a.kind != "checkpoint_stop":
                    hinted_starts.add(a.job)
                    continue  # the placement agent places it
            if a.kind == "weight" and a.job in hinted_starts:
                self._weighed(a)
                continue  # no container yet: the placement agent sends it with its place decision
            decisions.append(self._decision(a, ev.ts))
        controls = [JobControl(id=hashlib.blake2b(f"priority|{d.id}".encode(), digest_size=12).hexdigest(),
                               job=d.details.get("job", d.container), ts=ev.ts,
                               action="checkpoint_exit", policy="priority", reason=d.reason,
                               grace_s=d.details.get("grace_s"))
                    for d in decisions if d.action == "terminate"]
        self.hints += hints
        return decisions, controls

    def _submitted(self, ev: JobEvent) -> list[Action]:
        if ev.spec is None:
            raise Refused(f"JobEvent: submitted job {ev.job!r} carries no spec (requests)")
        if self.submitters is not None:
            self.submitters.refresh()
            why = self.submitters.verify_event(ev)
            if why is not None:
                raise SignatureRefused(f"JobEvent: submitted job {ev.job!r} refused: {why}")
        host = ev.host or self.default_host
        if self.policy.state(ev.job) is not None:
            raise Refused(f"JobEvent: job {ev.job!r} was already submitted")
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
        self.jobs[ev.job] = {"sub": start_details(ev), "gpu": r.gpus > 0, "ctr": ev.job}
        return self.policy.submit(req, now=ev.ts)

    def _started(self, ev: JobEvent) -> list[Action]:
        info = self.jobs.get(ev.job)
        if info is None:
            return []  # a job submitted before this agent, or never: not the policy's
        if ev.container:
            info["ctr"] = ev.container
        if self.policy.state(ev.job) != "running":
            return []
        w = self.policy.weight_action(ev.job, why="started")
        if w is None or info.get("w") == w.details["cpu_weight"]:
            return []  # its weight went with (or right after) the decision that started it
        return [w]

    def _weighed(self, a: Action) -> None:
        """Remember the CPU weight sent for *a*'s job, so that its ``started`` event does not send it again."""
        info = self.jobs.get(a.job)
        if info is not None:
            info["w"] = a.details["cpu_weight"]

    def take_hints(self) -> list[JobEvent]:
        """The hints caused since the last call (``launcher = place``), in order; cleared."""
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

    def partition(self, job: str) -> int:
        p = self.partition_of.get(job)
        return p if p is not None else zlib.crc32(job.encode()) % self.partitions

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the jobs changed since the last call."""
        out = []
        for job in sorted(self._dirty):
            st = self.policy.job_state(job)
            p = self.partition(job)
            if st is None:
                out.append((job, p, None))
                self.partition_of.pop(job, None)
                self.offset_of.pop(job, None)
                self.jobs.pop(job, None)
                continue
            value = {"p": p, "o": self.offset_of.get(job), "s": st, "job": self.jobs.get(job, {})}
            out.append((job, p, json.dumps(value, separators=(",", ":")).encode()))
        self._dirty.clear()
        return out

    def restore(self, items: Any) -> int:
        """The policy again from the table's ``(key, value)`` items; how many jobs."""
        self.policy = PriorityPolicy(self.config, {})
        self.jobs.clear()
        self.partition_of.clear()
        self.offset_of.clear()
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
                self.partition_of[job] = int(v["p"])
                if v.get("o") is not None:
                    self.offset_of[job] = int(v["o"])
                n += 1
            except (ValueError, KeyError, TypeError) as e:  # a state this version cannot read
                log.error("priorities: cannot restore job %s (%s); it is known again from its next submitted "
                          "event", job, e)
        return n


def register_priorities(app: Any, settings: Settings, *, outputs: Any, barrier: Any,
                        dead_letter: Callable[[Any, str, str], Awaitable[None]],
                        sign: Callable[[str, bytes, bytes], Any] | None = None,
                        verify: Callable[[str, bytes | None, bytes | None, Any], str | None] | None = None,
                        ) -> PriorityStep:
    """Add the priority agent and its state table to *app*; its decisions, controls and hints go through
    *outputs*, decisions and hints signed with *sign* (the cluster key's headers; ``None``: unsigned), the
    ``started`` events checked with *verify* (``None``: taken as they come)."""
    from phasewise.streams.config import intake_config
    from phasewise.streams.job_inputs import refused_output
    from phasewise.streams.output import JobStateTable
    from phasewise.streams.topics import raw_topic

    config, capacity = priority_config(settings)
    partitions = settings.kafka.topic_partitions or JOB_EVENTS.partitions
    step = PriorityStep(config, capacity, settings.host, partitions=partitions,
                        clock=EventClock(intake_config(settings), what="job"), launcher=settings.priority.launcher,
                        verify=verify, submitters=trusted_submitters(settings.jobs.trusted_submitters))
    topic = raw_topic(app, JOB_EVENTS, partitions)
    ensure_restored = JobStateTable(
        app, barrier, TABLE_NAME, partitions=partitions, state=step,
        help="priorities: each job's policy entry, submission, container and last event (key: job)",
        on_restored=lambda n: log.info("priorities: restored %d job(s): %s", n, step.policy.states()),
    ).ensure_restored

    @app.agent(topic, name="phasewise.priorities")
    async def on_job_events(stream: Any) -> None:
        async for event in stream.events():
            ensure_restored()
            msg = event.message
            try:
                decisions, controls = step.handle(msg.value, msg.partition, msg.offset, key=msg.key,
                                                  headers=msg.headers)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            except EventTimeRefused as e:
                await dead_letter(event, str(e), "event_time")
                continue
            except SignatureRefused as e:
                await dead_letter(event, str(e), "signature")
                continue
            except Refused as e:
                await dead_letter(event, str(e), "refused")
                continue
            except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
                step.take_hints()  # (none are left by a failed record; nothing stale goes out with the next)
                log.exception("the priority policy failed on a job event")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
                continue
            # an output refused for itself (too large for the producer or the broker) makes this event a dead
            # letter instead of failing the worker on it after every restart
            refused = refused_output(dead_letter, event)
            for d in decisions:
                key, value = d.host.encode(), encode(d)
                headers = None if sign is None else sign(DECISIONS.name, key, value)
                outputs.send(DECISIONS.name, key, value, headers, on_refused=refused)
                log.info("priority decision %s %s/%s: %s", d.action, d.host, d.container, d.reason)
            for c in controls:
                outputs.send(CONTROL.name, c.job.encode(), encode(c), on_refused=refused)
            for h in step.take_hints():
                key, value = h.job.encode(), encode(h)
                outputs.send(JOB_EVENTS.name, key, value, None if sign is None else sign(JOB_EVENTS.name, key, value),
                             on_refused=refused)
                log.info("priority hint %s %s on %s%s", h.kind, h.job, h.host, " (resume)" if h.resume else "")
            outputs.poll()

    return step
