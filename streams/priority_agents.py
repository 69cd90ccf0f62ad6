"""The priority agent (``phasewise worker --priorities``): job events in; freeze, thaw, terminate, place out.

For every record on the job-events topic (key: job):

- decode it as a :class:`~phasewise.schemas.JobEvent`; what does not decode
  (a null value, bytes that are not JSON, nesting too deep, wrong types,
  another schema version) is a dead letter with the parser's reason, and the
  agent carries on;
- ``submitted``: the job (its ``spec.requests``, ``priority``, ``workload``,
  ``spec.expected_s``, on its ``host`` or this worker's ``--host``) goes to
  :class:`~phasewise.models.priorities.PriorityPolicy`; a submission the
  policy refuses (no spec, a job id submitted twice) is a dead letter with
  the reason, and the policy is unchanged;
- ``finished``: the job's capacity frees, and waiting jobs are thawed,
  restarted or started in priority order;
- ``started`` and ``progress`` records are not the priority agent's concern.

Each action becomes a :class:`~phasewise.schemas.Decision` (``policy="priority"``:
``freeze`` / ``thaw`` for the actuator's cgroup freezer, ``terminate`` with
``details.mode = "checkpoint"`` for checkpoint-and-stop, ``place`` for a start
or a restart) sent to the decisions topic keyed by host; a checkpoint-and-stop
also sends :class:`~phasewise.schemas.JobControl` ``checkpoint_exit`` (with the
grace period) to the control topic keyed by job, which the job's progress
reporter delivers. Everything goes through the worker's output producer, so
an offset is committed only after what its record caused was delivered.

The policy's state lives in this worker's memory: it must be the only worker
with ``--priorities`` (it holds every host's view), and a restarted worker
starts with no jobs (it does not re-read the events committed before).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from phasewise.models.priorities import Capacity, JobRequest, PriorityConfig, PriorityPolicy, to_decision
from phasewise.schemas import Decision, JobControl, JobEvent, SchemaError, decode, encode
from phasewise.settings import Settings
from phasewise.topics import CONTROL, DECISIONS, JOB_EVENTS

__all__ = ["PriorityStep", "Refused", "priority_config", "register_priorities"]

log = logging.getLogger(__name__)


class Refused(ValueError):
    """A valid record the policy cannot take (``str(e)`` is the reason for its dead letter)."""


def priority_config(settings: Settings) -> tuple[PriorityConfig, Capacity]:
    """The policy's parameters and every host's capacity from settings (0 = this host's cores / memory)."""
    p = settings.priority
    cpu = p.host_cpu_cores or float(os.cpu_count() or 1)
    mem = float(p.host_mem_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return PriorityConfig(freeze_max_wait_s=p.freeze_max_wait_s, grace_s=p.grace_s), Capacity(cpu, mem, p.host_gpus)


class PriorityStep:
    """Raw job-event records -> decisions and control records (the agent without Faust)."""

    def __init__(self, config: PriorityConfig, capacity: Capacity, default_host: str) -> None:
        self.policy = PriorityPolicy(config, {})
        self.capacity = capacity
        self.default_host = default_host

    def handle(self, raw: bytes | None) -> tuple[list[Decision], list[JobControl]]:
        """What one record causes; raises :class:`SchemaError` or :class:`Refused` for a dead letter."""
        ev = decode(JobEvent, raw)
        if ev.kind == "submitted":
            if ev.spec is None:
                raise Refused(f"JobEvent: submitted job {ev.job!r} carries no spec (requests)")
            host = ev.host or self.default_host
            if not self.policy.knows_host(host):
                self.policy.add_host(host, self.capacity)
            if self.policy.state(ev.job) is not None:
                raise Refused(f"JobEvent: job {ev.job!r} was already submitted")
            r = ev.spec.requests
            try:
                req = JobRequest(ev.job, host, cpu_cores=r.cpu_cores or 0.0, mem_bytes=r.mem_bytes or 0.0,
                                 gpus=r.gpus, priority=ev.priority, workload=ev.workload,
                                 expected_s=ev.spec.expected_s)
            except ValueError as e:
                raise Refused(f"JobEvent: job {ev.job!r}: {e}") from None
            actions = self.policy.submit(req, now=ev.ts)
        elif ev.kind == "finished":
            actions = self.policy.finish(ev.job, now=ev.ts)
        else:
            return [], []
        decisions = [to_decision(a, ev.ts) for a in actions]
        controls = [JobControl(id=hashlib.blake2b(f"priority|{d.id}".encode(), digest_size=12).hexdigest(),
                               job=d.container, ts=ev.ts, action="checkpoint_exit", policy="priority",
                               reason=d.reason, grace_s=d.details.get("grace_s"))
                    for d in decisions if d.action == "terminate"]
        return decisions, controls


def register_priorities(app: Any, settings: Settings, *, outputs: Any,
                        dead_letter: Callable[[Any, str, str], Awaitable[None]]) -> PriorityStep:
    """Add the priority agent to *app*; its decisions and controls go through *outputs*."""
    from phasewise.streams.topics import raw_topic

    config, capacity = priority_config(settings)
    step = PriorityStep(config, capacity, settings.host)
    topic = raw_topic(app, JOB_EVENTS, settings.kafka.topic_partitions or None)

    @app.agent(topic, name="phasewise.priorities")
    async def on_job_events(stream: Any) -> None:
        async for event in stream.events():
            try:
                decisions, controls = step.handle(event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            except Refused as e:
                await dead_letter(event, str(e), "refused")
                continue
            except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
                log.exception("the priority policy failed on a job event")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
                continue
            for d in decisions:
                outputs.send(DECISIONS.name, d.host.encode(), encode(d))
                log.info("priority decision %s %s/%s: %s", d.action, d.host, d.container, d.reason)
            for c in controls:
                outputs.send(CONTROL.name, c.job.encode(), encode(c))
            outputs.poll()

    return step
