"""The targets agent (``phasewise worker --targets``): job events and samples in, TRADL decisions and
controls out.

The wiring of :class:`~phasewise.models.jobs.targets_step.TargetsStep` in the samples worker's app: each
job event is handed to the step, the samples agent hands it every admitted samples message, a timer the
hard stops; ``limit`` and ``terminate`` decisions (keyed by host, signed with the cluster key) and
``checkpoint_exit`` controls (keyed by job) go through the worker's output producer, a record it cannot
take is a dead letter. State: the changelogged table ``targets-state`` (key: job). One worker runs
``--targets``. Narrative: docs/targets.md, "In the worker".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from phasewise.kit.records import Decision, HostSamples, JobControl, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import CONTROL, JOB_EVENTS
from phasewise.models.jobs.targets_step import TargetsStep
from phasewise.models.safety.intake import EventClock
from phasewise.streams.agents.scaffold import Context, JobAgent, step_outcome
from phasewise.streams.config import intake_config, targets_step_config

__all__ = ["TABLE_NAME", "agent", "register_targets"]

log = logging.getLogger(__name__)

TABLE_NAME = "targets-state"


def make_step(ctx: Context) -> TargetsStep:
    return TargetsStep(targets_step_config(ctx.settings), clock=EventClock(intake_config(ctx.settings), what="job"),
                       now=time.time, verify=ctx.verify_job_events())


def restored(ctx: Context, n: int) -> None:
    if n:
        log.info("targets: restored %d followed job(s)", n)


agent = JobAgent("targets", TABLE_NAME, "targets: each followed job's tracker, placement, use and limit (key: job)",
                 state=make_step, on_restored=restored)


def emit(ctx: Context, decisions: list[Decision], controls: list[JobControl],
         on_refused: Callable[[str], None] | None = None) -> None:
    for d in decisions:
        ctx.send_decision(d, on_refused=on_refused)
        log.info("targets: %s %s/%s: %s", d.action, d.host, d.container, d.reason)
    for c in controls:
        ctx.send(CONTROL.name, c.job.encode(), encode(c), on_refused=on_refused)
        log.info("targets: %s to %s: %s", c.action, c.job, c.reason)


@agent.on(JOB_EVENTS, "phasewise.targets")
async def on_job_events(ctx: Context, event: Any) -> None:
    step: TargetsStep = ctx.state
    out = await step_outcome(ctx, event, lambda m: step.handle(m.value, m.partition, m.offset, key=m.key,
                                                               headers=m.headers),
                             "processing a job event failed")
    ctx.count_ignored(step.lifecycle.take_counts(), "targets")
    if out is not None:  # an output refused for itself (too large) makes the job event a dead letter
        emit(ctx, *out, on_refused=ctx.refused_output(event))
    ctx.outputs.poll()


@agent.every(1.0, "phasewise.targets-hard-stops")
async def hard_stops(ctx: Context) -> None:
    emit(ctx, ctx.state.tick(time.time()), [])
    ctx.outputs.poll()


def register_targets(app: Any, settings: Settings, *, metrics: Any, outputs: Any, barrier: Any,
                     dead_letter: Any, keyring: Any) -> Callable[[HostSamples], None]:
    """Add the job-events agent, its state table and its hard-stop timer to the samples worker's *app*;
    returns what the samples agent hands each admitted samples message to."""
    ctx = agent.register(app, settings, metrics=metrics, outputs=outputs, barrier=barrier, dead_letter=dead_letter,
                         keyring=keyring)

    def samples(hs: HostSamples) -> None:
        """The followed jobs' use and the host's cores: the decisions a new division of a node causes."""
        ctx.ensure_restored()
        emit(ctx, ctx.state.samples(hs), [])

    return samples
