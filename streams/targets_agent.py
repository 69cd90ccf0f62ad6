"""The targets agent (``phasewise worker --targets``): job events in, TRADL decisions and controls out.

For every record on ``phasewise.job-events.v1`` (key: job):

- decode it as a :class:`~phasewise.schemas.JobEvent`; a record that is not one
  (a null value, bytes that are not JSON, nesting too deep, a 600 kB binary,
  wrong types) is dead-lettered with the parser's reason;
- hand it to :class:`~phasewise.models.targets.TargetsFleet`: ``submitted`` with
  ``spec.targets`` starts following the job, ``started`` says where it runs,
  ``finished`` ends it; a ``progress`` event it cannot use (an unknown job, a
  NaN loss, steps going backwards, an absurd value) is dead-lettered with the
  reason and the job's state is untouched;
- send what the event causes through the worker's output producer: at
  *acceptable* a ``limit`` decision (keyed by host, on the decisions topic), at
  *objective* a ``checkpoint_exit`` :class:`~phasewise.schemas.JobControl` (keyed
  by job, on ``phasewise.control.v1``), and once ``targets_grace_s`` has passed
  without ``finished``, a ``terminate`` decision (checked every second).

The trackers live in the worker's memory (a restarted worker follows a job again
from its next ``submitted``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from phasewise.models.targets import TargetsConfig, TargetsFleet
from phasewise.schemas import Decision, JobControl, JobEvent, SchemaError, decode, encode
from phasewise.settings import Settings
from phasewise.topics import CONTROL, DECISIONS, JOB_EVENTS

__all__ = ["TargetsHandler", "fleet_from_settings", "register_targets"]

log = logging.getLogger(__name__)


def fleet_from_settings(settings: Settings) -> TargetsFleet:
    t = settings.targets
    config = TargetsConfig(smoothing="ewma", alpha=t.ewma_alpha, patience=t.patience, grace_s=t.grace_s)
    return TargetsFleet(config, capacity=lambda host: t.node_cores, shrink=t.shrink, default_host=settings.host)


class TargetsHandler:
    """One record at a time: decode, follow, and say what to send or why it is a dead letter."""

    def __init__(self, fleet: TargetsFleet, send: Callable[[str, bytes | None, bytes], None],
                 dead_letter: Callable[[Any, str], Any]) -> None:
        self.fleet = fleet
        self.send = send
        self.dead_letter = dead_letter
        self.decisions = 0
        self.controls = 0
        self.rejected = 0

    def emit(self, decisions: list[Decision], controls: list[JobControl]) -> None:
        for d in decisions:
            self.send(DECISIONS.name, d.host.encode(), encode(d))
            log.info("targets: %s %s/%s: %s", d.action, d.host, d.container, d.reason)
        for c in controls:
            self.send(CONTROL.name, c.job.encode(), encode(c))
            log.info("targets: %s to %s: %s", c.action, c.job, c.reason)
        self.decisions += len(decisions)
        self.controls += len(controls)

    def handle(self, event: Any, raw: bytes | None) -> None:
        try:
            ev = decode(JobEvent, raw)
        except SchemaError as e:
            self.rejected += 1
            self.dead_letter(event, str(e))
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
        self.emit(decisions, controls)

    def tick(self, now: float) -> None:
        self.emit(self.fleet.due(now), [])


def register_targets(app: Any, settings: Settings, *, outputs: Any, dead_letter: Callable[..., Any]) -> TargetsHandler:
    """Add the job-events agent and its hard-stop timer to *app*."""
    from phasewise.streams.topics import raw_topic

    pending: list[tuple[Any, str]] = []

    def note(event: Any, reason: str) -> None:
        pending.append((event, reason))

    handler = TargetsHandler(fleet_from_settings(settings), outputs.send, note)
    topic = raw_topic(app, JOB_EVENTS)

    @app.agent(topic, name="phasewise.targets")
    async def on_job_events(stream: Any) -> None:
        async for event in stream.events():
            handler.handle(event, event.message.value)
            while pending:
                ev, reason = pending.pop(0)
                await dead_letter(ev, reason, "schema")
            outputs.poll()

    @app.timer(1.0)
    async def hard_stops() -> None:
        handler.tick(time.time())
        outputs.poll()

    return handler
