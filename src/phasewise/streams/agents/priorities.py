"""The priority agent (``phasewise worker --priorities``): job events in; place, freeze, thaw, terminate,
weight decisions, checkpoint controls and admission hints out.

The wiring of :class:`~phasewise.models.jobs.priority_step.PriorityStep` (DynamoML's preemption and CPU
weights) in the samples worker's app: each job event is handed to the step, what it causes goes through
the worker's output producer (decisions keyed by host and signed with the cluster key, controls keyed by
job, hints on the job events signed), a record it cannot take is a dead letter. A job it started itself
(``priority_launcher=self``) with no ``started`` event within ``job_start_timeout_s`` is released as
``lost`` (a signed job event, a dead letter, ``phasewise_worker_jobs_lost_total{agent="priorities"}``).
State: the changelogged table ``priority-state`` (key: job). One worker runs ``--priorities``. Narrative:
docs/priorities.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phasewise.kit.records import encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, JOB_EVENTS
from phasewise.models.jobs.priority_step import PriorityStep
from phasewise.models.safety.intake import EventClock
from phasewise.streams.agents.scaffold import Context, JobAgent, step_outcome
from phasewise.streams.config import intake_config, priority_step_config, submissions

__all__ = ["TABLE_NAME", "agent", "register_priorities"]

log = logging.getLogger(__name__)

TABLE_NAME = "priority-state"


def make_step(ctx: Context) -> PriorityStep:
    return PriorityStep(priority_step_config(ctx.settings), submissions(ctx.settings),
                        clock=EventClock(intake_config(ctx.settings), what="job"), now=time.time,
                        verify=ctx.verify_job_events())


def restored(ctx: Context, n: int) -> None:
    if n:
        log.info("priorities: restored %d job(s): %s", n, ctx.state.policy.states())


agent = JobAgent("priorities", TABLE_NAME,
                 "priorities: each job's policy entry, submission, container and last event (key: job)",
                 state=make_step, on_restored=restored)


@agent.on(JOB_EVENTS, "phasewise.priorities")
async def on_job_events(ctx: Context, event: Any) -> None:
    step: PriorityStep = ctx.state
    out = await step_outcome(ctx, event, lambda m: step.handle(m.value, m.partition, m.offset, key=m.key,
                                                               headers=m.headers),
                             "the priority policy failed on a job event")
    ctx.count_ignored(step.lifecycle.take_counts(), "priorities")
    if out is None:
        return
    decisions, controls = out
    # an output refused for itself (too large for the producer or the broker) makes this event a dead
    # letter instead of failing the worker on it after every restart
    emit(ctx, decisions, controls, ctx.refused_output(event))


def emit(ctx: Context, decisions: list, controls: list, refused: Any = None) -> None:
    """Send what the step decided: its hints (signed), decisions (signed), then checkpoint controls. A ``stopped``
    hint goes before the control that makes the job exit, so the job's events hold the stop before its exit."""
    step: PriorityStep = ctx.state
    for h in step.take_hints():
        ctx.send(JOB_EVENTS.name, h.job.encode(), encode(h), signed=True, on_refused=refused)
        log.info("priority hint %s %s on %s%s", h.kind, h.job, h.host, " (resume)" if h.resume else "")
    for d in decisions:
        ctx.send_decision(d, on_refused=refused)
        log.info("priority decision %s %s/%s: %s", d.action, d.host, d.container, d.reason)
    for c in controls:
        ctx.send(CONTROL.name, c.job.encode(), encode(c), on_refused=refused)
    ctx.outputs.poll()


@agent.every(1.0, "phasewise.priorities-lost")
async def lost(ctx: Context) -> None:
    """The jobs this agent started (``priority_launcher=self``) that no ``started`` event reached within
    ``job_start_timeout_s``: released as lost, and what that frees decided."""
    step: PriorityStep = ctx.state
    decisions, controls, lost_events = step.expire(time.time())
    for ev in lost_events:
        ctx.lost(ev, None)
        ctx.metrics.jobs_lost.labels(agent="priorities").inc()
    if decisions or controls or step.hints:
        emit(ctx, decisions, controls)


def register_priorities(app: Any, settings: Settings, *, metrics: Any, outputs: Any, barrier: Any,
                        dead_letter: Any, keyring: Any) -> PriorityStep:
    """Add the priority agent and its state table to the samples worker's *app*, with its *outputs*,
    *barrier*, *dead_letter* and *keyring* (``None``: decisions and hints unsigned, ``started`` events
    taken as they come)."""
    return agent.register(app, settings, metrics=metrics, outputs=outputs, barrier=barrier,
                          dead_letter=dead_letter, keyring=keyring).state
