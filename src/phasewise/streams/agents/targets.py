"""The targets agent (``phasewise worker --targets``): job events and samples in, TRADL decisions and controls out.

For every record on ``phasewise.job-events.v1`` (key: job):

- decode it as a :class:`~phasewise.kit.records.JobEvent`; a record that is not one
  (a null value, bytes that are not JSON, nesting too deep, a 600 kB binary,
  wrong types) is dead-lettered with the parser's reason;
- hand it to :class:`~phasewise.models.jobs.targets.TargetsFleet`: ``submitted`` with
  ``spec.targets`` starts following the job (a ``submitted`` event's
  ``container`` is ignored), ``started`` says where it runs (host, container;
  with a cluster key, only a ``started`` event signed with it, the
  actuator's: another is dead-lettered), ``finished`` ends it; a ``progress`` event it cannot use
  (an unknown job, a NaN loss, steps going backwards, an absurd value) is
  dead-lettered with the reason and the job's state is untouched; other kinds
  (``priority``, the priority agent's ``admitted`` and ``stopped`` hints) are
  not its concern: skipped before anything is checked, never dead-lettered;
- send what the event causes through the worker's output producer: at
  *objective* a ``checkpoint_exit`` :class:`~phasewise.kit.records.JobControl` (keyed
  by job, on ``phasewise.control.v1``), and once ``targets_grace_s`` has passed
  without ``finished``, a ``terminate`` decision (checked every second), which the
  actuator carries out; and ``limit`` decisions (keyed by host) for every job of
  the node whose CPU limit the node's new division changed
  (:func:`~phasewise.models.jobs.targets.node_limits`: ``targets_policy``, the share
  rule with ``targets_share_alpha``).

The samples agent hands it every admitted samples message (:meth:`TargetsHandler.samples`):
the use of the followed jobs' containers and each host's CPU count. With the
share rule on, a node is divided again every ``targets_share_interval_s`` of
samples.

State: the changelogged table ``targets-state`` (key: job) holds each followed
job's tracker, where it runs, what it used and the limit set last; written at
the worker's offset commits through the commit barrier (its outputs delivered
first), restored when the worker starts or takes its partitions back. A job's
state goes to the changelog partition of its job events, with the offset of
the last of its events it holds: a worker that died after a commit wrote the
table but before it committed the offsets reads those events again, and skips
them. One worker runs ``--targets`` (a node's jobs are divided together, and it
reads every host's samples).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from collections.abc import Callable
from typing import Any

from phasewise.kit.records import Decision, JobControl, JobEvent, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, DECISIONS, JOB_EVENTS
from phasewise.models.jobs.targets import TargetsConfig, TargetsFleet
from phasewise.models.safety.intake import EventClock

__all__ = ["TABLE_NAME", "TargetsHandler", "fleet_from_settings", "register_targets"]

log = logging.getLogger(__name__)

TABLE_NAME = "targets-state"


def fleet_from_settings(settings: Settings) -> TargetsFleet:
    t = settings.targets
    config = TargetsConfig(smoothing="ewma", alpha=t.ewma_alpha, patience=t.patience, grace_s=t.grace_s)
    return TargetsFleet(config, capacity=lambda host: t.node_cores, shrink=t.shrink, default_host=settings.host,
                        policy=t.policy, share_alpha=t.share_alpha or None, share_interval_s=t.share_interval_s)


#: the job-event kinds the targets agent acts on; the others are skipped, never dead-lettered
ACTS_ON = frozenset({"submitted", "started", "progress", "finished"})


class TargetsHandler:
    """One record at a time: decode, follow, and say what to send or why it is a dead letter.

    *partitions*: the job-events topic's partition count (a job's state goes to the
    changelog partition of its events; a job restored without events yet, to its
    stored one).
    """

    def __init__(self, fleet: TargetsFleet, send: Callable[..., None],
                 dead_letter: Callable[..., Any], *, partitions: int = JOB_EVENTS.partitions,
                 sign: Callable[[str, bytes, bytes], Any] | None = None, clock: EventClock | None = None,
                 now: Callable[[], float] = time.time,
                 verify: Callable[[str, bytes | None, bytes | None, Any], str | None] | None = None) -> None:
        self.fleet = fleet
        #: the event-time rule per job (``None``: none); a refused event is dead-lettered with kind
        #: ``event_time`` (*dead_letter* then gets it as a third argument)
        self.clock = clock
        self.now = now
        self.send = send
        self.dead_letter = dead_letter
        self.partitions = partitions
        self.sign = sign
        #: the cluster key's check of a record (``Keyring.verify``; ``None``: no key): a ``started`` event's
        #: container is taken only from a record it passes (the actuator's)
        self.verify = verify
        self.partition_of: dict[str, int] = {}
        #: job -> offset of the last of its events the state holds (in its partition): an event at or
        #: before it, read again after a restart whose last offsets were not committed, is not applied twice
        self.offset_of: dict[str, int] = {}
        #: called before samples and timer ticks are handled (the agent restores the table there)
        self.ensure_restored: Callable[[], None] = lambda: None
        #: event -> the ``on_refused`` handler of the outputs it causes (None: a refusal fails the worker)
        self.refused_for: Callable[[Any], Callable[[str], None] | None] = lambda event: None
        self.decisions = 0
        self.controls = 0
        self.rejected = 0
        self.replayed = 0

    def emit(self, decisions: list[Decision], controls: list[JobControl],
             on_refused: Callable[[str], None] | None = None) -> None:
        extra = {} if on_refused is None else {"on_refused": on_refused}
        for d in decisions:
            key, value = d.host.encode(), encode(d)
            if self.sign is None:
                self.send(DECISIONS.name, key, value, **extra)
            else:
                self.send(DECISIONS.name, key, value, self.sign(DECISIONS.name, key, value), **extra)
            log.info("targets: %s %s/%s: %s", d.action, d.host, d.container, d.reason)
        for c in controls:
            self.send(CONTROL.name, c.job.encode(), encode(c), **extra)
            log.info("targets: %s to %s: %s", c.action, c.job, c.reason)
        self.decisions += len(decisions)
        self.controls += len(controls)

    def handle(self, event: Any, raw: bytes | None, partition: int | None = None, offset: int | None = None, *,
               key: bytes | None = None, headers: Any = None) -> None:
        try:
            ev = decode(JobEvent, raw)
        except SchemaError as e:
            self.rejected += 1
            self.dead_letter(event, str(e))
            return
        if ev.kind not in ACTS_ON:  # not this agent's concern (its time is not the job's own either)
            return
        if ev.kind == "submitted" and ev.container is not None:
            ev = dataclasses.replace(ev, container=None)  # a job's container is its id until an actuator says
        if ev.kind == "started" and self.verify is not None and ev.job in self.fleet.jobs:
            why = self.verify(JOB_EVENTS.name, key, raw, headers)
            if why is not None:
                self.rejected += 1
                self.dead_letter(event, f"JobEvent started {ev.job}: not signed by the cluster key ({why}): its "
                                        f"container is not taken")
                return
        seen = self.offset_of.get(ev.job)
        if (seen is not None and offset is not None and offset <= seen
                and self.partition_of.get(ev.job) == partition):
            self.replayed += 1  # its effect is in the restored state already
            return
        if self.clock is not None and (why := self.clock.admit(ev.job, ev.ts, now=self.now())) is not None:
            self.rejected += 1
            self.dead_letter(event, f"JobEvent {ev.kind} {ev.job}: {why}", "event_time")
            return
        try:
            decisions, controls, why = self.fleet.process(ev)
        except Exception as e:  # a bug on a valid record: dead-letter it, keep going
            log.exception("processing a job event failed")
            self.rejected += 1
            self.dead_letter(event, f"processing failed: {type(e).__name__}: {e}")
            return
        if why is not None:
            self.rejected += 1
            self.dead_letter(event, why)
            return
        if ev.job in self.fleet.jobs:  # (a job it does not follow leaves nothing behind)
            if partition is not None:
                self.partition_of[ev.job] = partition
            if offset is not None:
                self.offset_of[ev.job] = offset
        self.emit(decisions, controls, self.refused_for(event))

    def samples(self, hs: Any) -> None:
        """A host's admitted samples (the samples agent calls this for every message it keeps)."""
        self.ensure_restored()
        self.emit(self.fleet.samples(hs), [])

    def tick(self, now: float) -> None:
        self.emit(self.fleet.due(now), [])

    # ------------------------------------------------------------------ state

    def partition(self, job: str) -> int:
        p = self.partition_of.get(job)
        return p if p is not None else zlib.crc32(job.encode()) % self.partitions

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the jobs changed since the last call."""
        out = []
        for job, state in self.fleet.pop_dirty():
            p = self.partition(job)
            value = {"p": p, "o": self.offset_of.get(job), "s": state}
            out.append((job, p, None if state is None else json.dumps(value, separators=(",", ":")).encode()))
            if state is None:
                self.partition_of.pop(job, None)
                self.offset_of.pop(job, None)
        return out

    def restore(self, items: Any) -> int:
        """Follow again the jobs of the table's ``(key, value)`` items; how many."""
        self.fleet.clear()
        self.partition_of.clear()
        self.offset_of.clear()
        n = 0
        for job, raw in items:
            if raw is None:
                continue
            try:
                v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
                self.fleet.load(job, v["s"])
                self.partition_of[job] = int(v["p"])
                if v.get("o") is not None:
                    self.offset_of[job] = int(v["o"])
                n += 1
            except (ValueError, KeyError, TypeError) as e:  # a state this version cannot read: start it over
                log.error("targets: cannot restore job %s (%s); it is followed again from its next submitted "
                          "event", job, e)
        self.fleet.pop_dirty()  # restored: nothing to write back
        return n


def register_targets(app: Any, settings: Settings, *, outputs: Any, dead_letter: Callable[..., Any],
                     barrier: Any, sign: Callable[[str, bytes, bytes], Any] | None = None,
                     verify: Callable[[str, bytes | None, bytes | None, Any], str | None] | None = None,
                     ) -> TargetsHandler:
    """Add the job-events agent, its state table and its hard-stop timer to *app*."""
    from phasewise.streams.config import intake_config
    from phasewise.streams.job_inputs import refused_output
    from phasewise.streams.output import JobStateTable
    from phasewise.streams.topics import raw_topic

    pending: list[tuple[Any, str, str]] = []

    def note(event: Any, reason: str, kind: str = "schema") -> None:
        pending.append((event, reason, kind))

    partitions = settings.kafka.topic_partitions or JOB_EVENTS.partitions
    handler = TargetsHandler(fleet_from_settings(settings), outputs.send, note, partitions=partitions, sign=sign,
                             clock=EventClock(intake_config(settings), what="job"), verify=verify)
    topic = raw_topic(app, JOB_EVENTS, partitions)
    state = JobStateTable(app, barrier, TABLE_NAME, partitions=partitions, state=handler,
                          help="targets: each followed job's tracker, placement, use and limit (key: job)",
                          on_restored=lambda n: log.info("targets: restored %d followed job(s)", n))
    ensure_restored = handler.ensure_restored = state.ensure_restored
    # an output refused for itself (too large) makes the job event that caused it a dead letter
    handler.refused_for = lambda event: refused_output(dead_letter, event)

    @app.agent(topic, name="phasewise.targets")
    async def on_job_events(stream: Any) -> None:
        async for event in stream.events():
            ensure_restored()
            msg = event.message
            handler.handle(event, msg.value, msg.partition, msg.offset, key=msg.key, headers=msg.headers)
            while pending:
                ev, reason, kind = pending.pop(0)
                await dead_letter(ev, reason, kind)
            outputs.poll()

    @app.timer(1.0)
    async def hard_stops() -> None:
        if state.restored:
            handler.tick(time.time())
            outputs.poll()

    return handler
