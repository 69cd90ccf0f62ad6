"""The targets agent's step (TRADL): one job event in; ``limit`` and ``terminate`` decisions and
``checkpoint_exit`` controls out.

:class:`TargetsStep` decodes a record of the job-events topic and hands it to the
:class:`~phasewise.models.jobs.targets.TargetsFleet`: ``submitted`` with targets starts following a
job, ``started`` says where it runs, ``progress`` is checked and learned, ``finished`` ends it. A
record it cannot take raises :class:`~phasewise.kit.records.SchemaError` or a
:class:`~phasewise.models.jobs.events.Refused`. The samples agent hands it each host's admitted samples
(:meth:`TargetsStep.samples`) and a timer the time (:meth:`TargetsStep.tick`: hard stops). It keeps each
followed job's state for the changelogged table (:meth:`writes`, :meth:`restore`). Narrative:
docs/targets.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import TERMINAL_KINDS, Decision, HostSamples, JobControl, JobEvent, decode
from phasewise.models.jobs.events import EventTimeRefused, JobPositions, Refused, SignatureRefused
from phasewise.models.jobs.lifecycle import END_KINDS, Lifecycle
from phasewise.models.jobs.targets import TargetsConfig, TargetsFleet
from phasewise.models.safety.intake import EventClock

__all__ = ["ACTS_ON", "TargetsStep", "TargetsStepConfig"]

log = logging.getLogger(__name__)

#: the job-event kinds the targets agent acts on; the others are skipped, never dead-lettered
ACTS_ON = frozenset({"submitted", "started", "stopped", "progress", "terminated"} | TERMINAL_KINDS)
#: the dead-letter kind of every refusal but the event-time rule's (as this agent has always counted them)
KIND = "schema"


@dataclass(frozen=True)
class TargetsStepConfig:
    """The targets agent's parameters (:func:`phasewise.streams.config.targets_step_config` maps the
    ``targets_*`` settings onto them)."""

    #: how progress values are smoothed and crossings confirmed
    tracker: TargetsConfig
    #: CPU cores of a node whose samples do not say
    node_cores: float
    #: the acceptable rule's share of a node for a job past acceptable
    shrink: float
    #: how a node is divided (:data:`~phasewise.models.jobs.targets.NODE_POLICIES`)
    policy: str
    #: the share rule's alpha (``None``: the share rule off)
    share_alpha: float | None
    #: seconds of samples between two divisions of a node by the share rule
    share_interval_s: float
    #: the host of a job no ``started`` event placed yet (this worker's ``host``)
    default_host: str
    #: the job-events topic's partition count (a job's state goes to the changelog partition of its events)
    partitions: int


class TargetsStep:
    """Raw job-event records -> decisions and controls (the agent without Faust), and its state.

    *clock*, *now*: the event-time rule per job and the worker's clock (``None``: no rule). *verify*: the
    cluster key's check of a job-events record ``(key, value, headers) -> why not`` (``None``: no key);
    a ``started`` event's container is taken only from a record it passes (the actuator's).
    """

    def __init__(self, config: TargetsStepConfig, *, clock: EventClock | None = None,
                 now: Callable[[], float] | None = None,
                 verify: Callable[[bytes | None, bytes | None, Any], str | None] | None = None) -> None:
        if clock is not None and now is None:
            raise ValueError("an event-time rule needs the worker's clock (now)")
        self.config = config
        self.fleet = TargetsFleet(config.tracker, capacity=lambda host: config.node_cores, shrink=config.shrink,
                                  default_host=config.default_host, policy=config.policy,
                                  share_alpha=config.share_alpha, share_interval_s=config.share_interval_s)
        self.clock = clock
        self.now = now
        self.verify = verify
        #: each followed job's changelog partition and the last of its events the state holds
        self.positions = JobPositions(config.partitions)
        self.replayed = 0
        #: the followed jobs seen ending, and the states ignored (counted by the agent)
        self.lifecycle = Lifecycle("targets")

    def handle(self, raw: bytes | None, partition: int | None = None, offset: int | None = None, *,
               key: bytes | None = None, headers: Any = None) -> tuple[list[Decision], list[JobControl]]:
        """What one record causes; raises :class:`SchemaError` or :class:`Refused` for a dead letter (the
        job's state untouched).

        *key*, *headers*: the record's, for the cluster key's check of a ``started`` event.
        """
        ev = decode(JobEvent, raw)
        if ev.kind not in ACTS_ON:  # not this agent's concern (its time is not the job's own either)
            return [], []
        if ev.kind == "submitted" and ev.container is not None:
            ev = dataclasses.replace(ev, container=None)  # a job's container is its id until an actuator says
        if ev.kind == "stopped" and ev.job not in self.fleet.jobs:
            return [], []  # the priority agent stopped a job it does not follow (no targets, or ended)
        if (ev.kind in ("started", "stopped") or ev.kind in END_KINDS) and self.verify is not None \
                and ev.job in self.fleet.jobs:
            why = self.verify(key, raw, headers)
            if why is not None:
                raise SignatureRefused(f"JobEvent {ev.kind} {ev.job}: not signed by the cluster key ({why}): "
                                       f"{'its container is not taken' if ev.kind == 'started' else 'nothing changes'}",
                                       KIND)
        if (ev.kind == "started" or ev.kind in END_KINDS) and ev.job not in self.fleet.jobs:
            # a job it does not follow: one without targets (not its concern), or one that ended
            if self.lifecycle.ended_as(ev.job) is not None and (
                    why := self.lifecycle.unheld(ev.job, ev.kind, ev.ts)) is not None:
                self.lifecycle.ignore(ev.job, ev.kind, why)
            return [], []
        if self.positions.seen(ev.job, partition, offset):
            self.replayed += 1  # its effect is in the restored state already
            return [], []
        # (a stopped hint is stamped by the event that caused the stop, often another job's: not this job's time)
        if self.clock is not None and ev.kind != "stopped" and (
                why := self.clock.admit(ev.job, ev.ts, now=self.now())) is not None:
            raise EventTimeRefused(f"JobEvent {ev.kind} {ev.job}: {why}")
        if ev.kind == "submitted" and ev.job in self.fleet.jobs:
            raise Refused(f"JobEvent: job id {ev.job!r} already submitted: this submission is refused; submit it "
                          f"under another id", "duplicate")
        try:
            decisions, controls, why = self.fleet.process(ev)
        except Exception as e:  # a bug on a valid record: dead-letter it, keep going
            log.exception("processing a job event failed")
            raise Refused(f"processing failed: {type(e).__name__}: {e}", KIND) from e
        if why is not None:
            raise Refused(why, KIND)
        if ev.kind in END_KINDS and ev.job not in self.fleet.jobs:
            self.lifecycle.end(ev.job, ev.kind, ev.ts)
        if ev.job in self.fleet.jobs:  # (a job it does not follow leaves nothing behind)
            self.positions.note(ev.job, partition, offset)
        return decisions, controls

    def samples(self, hs: HostSamples) -> list[Decision]:
        """A host's admitted samples (the samples agent hands it every message it keeps): the decisions a
        new division of a node causes."""
        return self.fleet.samples(hs)

    def tick(self, now: float) -> list[Decision]:
        """The hard stops due at *now*."""
        return self.fleet.due(now)

    # ------------------------------------------------------------------ state

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the jobs changed since the last call."""
        out = []
        for job, state in self.fleet.pop_dirty():
            p = self.positions.partition(job)
            value = {"p": p, "o": self.positions.offset(job), "s": state}
            out.append((job, p, None if state is None else json.dumps(value, separators=(",", ":")).encode()))
            if state is None:
                self.positions.forget(job)
        return out

    def restore(self, items: Any) -> int:
        """Follow again the jobs of the table's ``(key, value)`` items; how many."""
        self.fleet.clear()
        self.positions.clear()
        n = 0
        for job, raw in items:
            if raw is None:
                continue
            try:
                v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
                self.fleet.load(job, v["s"])
                self.positions.load(job, v["p"], v.get("o"))
                n += 1
            except (ValueError, KeyError, TypeError) as e:  # a state this version cannot read: start it over
                log.error("targets: cannot restore job %s (%s); it is followed again from its next submitted "
                          "event", job, e)
        self.fleet.pop_dirty()  # restored: nothing to write back
        return n
