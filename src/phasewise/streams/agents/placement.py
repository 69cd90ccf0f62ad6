"""The placement agents (``phasewise place``): samples, job events and predictions in, ``place`` decisions out.

The wiring of :class:`~phasewise.models.jobs.placement.state.PlacementState`: host samples become nodes,
``submitted`` jobs wait for their prediction and are placed by the policy, the states that end a job
(``finished``, ``failed``, ``rejected``, ``lost``, ``terminated`` unless the priority agent stopped it to
resume it) free them, a placed job with no ``started`` within ``job_start_timeout_s`` is released as
``lost`` (a signed job event, a dead letter, ``phasewise_place_jobs_lost_total``), the priority agent's
signed ``admitted`` and ``stopped`` hints (``place_after_admission``) say when;
predictions and hints are taken only when signed with the cluster key, decisions are signed with it. A
record that cannot be decoded or taken is a dead letter. State: the changelogged table ``place-state``
(``job/<id>``). Narrative: docs/placement.md, "The placement worker".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phasewise.kit.records import (
    TERMINAL_KINDS,
    JobEvent,
    SchemaError,
    UtilisationPrediction,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.topics import JOB_EVENTS, PREDICTIONS, SAMPLES
from phasewise.models.jobs.events import Refused
from phasewise.models.jobs.gpu_share import placement_shares
from phasewise.models.jobs.placement.state import NotTrusted, PlacementState
from phasewise.streams.agents.scaffold import Context, JobAgent
from phasewise.streams.config import placement_state_config, submissions
from phasewise.streams.job_inputs import Input
from phasewise.streams.metrics import PlacementMetrics

__all__ = ["TABLE_NAME", "PlacementMetrics", "agent", "register_placement"]

log = logging.getLogger(__name__)

TABLE_NAME = "place-state"

#: the job-event kinds only a role with the cluster key writes (the priority agent's hints, the actuator's
#: states, an agent's lost): with a key, taken only when signed with it
SIGNED_KINDS = frozenset({"admitted", "stopped", "started", "scaled", "frozen", "thawed", "terminated"}
                         | TERMINAL_KINDS)

agent = JobAgent(
    "place", TABLE_NAME, "place: submitted and placed jobs",
    state=lambda ctx: PlacementState(placement_state_config(ctx.settings), submissions(ctx.settings)),
    # one stamped far ahead or behind would order a job's wait, or a node's use, by a time that has not come
    event_time=("job", "prediction", "host"),
    restore_on_rebalance=True)  # its timer decides restored jobs with no record read


def decide(ctx: Context) -> None:
    """Decide what is due, send the decisions (each followed by its CPU weight, after admission), and the
    jobs refused for want of room (``place_max_waiting_jobs``) to the dead letters."""
    state: PlacementState = ctx.state
    metrics = ctx.metrics
    ctx.count_ignored(state.lifecycle.take_counts())
    t0 = time.perf_counter()
    made = state.decide(time.monotonic(), time.time())
    for d, _p in made:
        job = d.details.get("job", d.container)
        shares = placement_shares(state, d, d.ts)  # a share of one GPU: its share goes first, the others' after
        for s in shares[:1]:
            ctx.send_decision(s)
        ctx.send_decision(d, on_refused=refused_for(ctx, job))
        for s in shares[1:]:
            ctx.send_decision(s)
        if job not in state.placed:
            continue  # refused at once (too large for the producer): no weight follows
        metrics.decisions.inc()
        log.info("placed %s on %s %s: %s", d.container, d.details["node"], d.details["device"], d.reason)
        w = state.start_weight(d)
        if w is not None:  # after the place decision, on the same partition: the container exists by then
            ctx.send_decision(w)
            log.info("weight %s: %s", w.container, w.reason)
    if made:
        metrics.decide_seconds.observe((time.perf_counter() - t0) / len(made))
    for ev in state.take_waits():  # why a job waits, for `phasewise jobs` and subscribers (signed)
        ctx.send(JOB_EVENTS.name, ev.job.encode(), encode(ev), signed=True)
    for ev, why in state.take_refused():  # dropped, told on the dead-letter topic
        ctx.capacity_letter(JOB_EVENTS, ev.job.encode(), encode(ev), why)
    metrics.waiting.set(len(state.waiting))
    metrics.nodes.set(len(state.cluster))
    ctx.outputs.poll()


def refused_for(ctx: Context, job: str) -> Any:
    """The ``on_refused`` handler of *job*'s place decision: the job is forgotten (what it booked frees, it
    is not decided again) and its submitted event becomes a dead letter."""
    ev = ctx.state.events.get(job)
    letter = ctx.refused_output(Input(JOB_EVENTS.name, job.encode(), None if ev is None else encode(ev)))

    def refused(why: str) -> None:
        ctx.state.finished(job)
        letter(why)

    return refused


@agent.on(JOB_EVENTS, "phasewise.place-jobs")
async def on_jobs(ctx: Context, event: Any) -> None:
    state: PlacementState = ctx.state
    try:
        ev = decode(JobEvent, event.message.value)
        if ev.kind not in state.acts_on:
            return  # progress, priority; the hints unless after admission: not this agent's concern
        if ev.kind in SIGNED_KINDS and await ctx.unsigned(event, f"JobEvent {ev.kind} {ev.job}"):
            return  # the priority agent's hints, the actuator's states: with a key, only those signed with it
        if await ctx.refused_time(event, "job", ev.job, ev.ts):
            return
        state.job_event(ev, time.monotonic())
    except NotTrusted as e:
        await ctx.dead_letter(event, str(e), "signature")
        return
    except Refused as e:  # a second submission of a known id, targets in the wrong order
        await ctx.dead_letter(event, str(e), e.kind)
        return
    except (SchemaError, ValueError) as e:
        await ctx.dead_letter(event, str(e), "schema")
        return
    decide(ctx)


@agent.on(PREDICTIONS, "phasewise.place-predictions")
async def on_predictions(ctx: Context, event: Any) -> None:
    if (pred := await ctx.decoded(event, lambda raw: decode(UtilisationPrediction, raw))) is None:
        return
    if await ctx.unsigned(event, f"prediction for {pred.job}"):
        return
    if await ctx.refused_time(event, "prediction", pred.job, pred.ts):
        return
    ctx.state.prediction(pred)
    decide(ctx)


@agent.on(SAMPLES, "phasewise.place-samples")
async def on_samples(ctx: Context, event: Any) -> None:
    if (hs := await ctx.decoded(event, decode_host_samples)) is None:
        return
    if await ctx.refused_time(event, "host", hs.host, hs.ts):
        return
    try:
        changed = ctx.state.samples(hs)
    except ValueError as e:
        await ctx.dead_letter(event, f"node update refused: {e}", "processing")
        return
    if changed and ctx.state.waiting:
        decide(ctx)


@agent.every(0.25, "phasewise.place-tick")
async def tick(ctx: Context) -> None:
    lost = ctx.state.expire(time.time())  # bookings with no started event within job_start_timeout_s
    for ev, submitted in lost:
        ctx.lost(ev, submitted)
        ctx.metrics.jobs_lost.inc()
    if lost or ctx.state.pending(time.monotonic()):
        decide(ctx)


def register_placement(app: Any, settings: Any, *, metrics: PlacementMetrics | None = None,
                       outputs: Any = None) -> Context:
    """Add the state table, the three agents and the decision timer to *app*."""
    return agent.register(app, settings, metrics=metrics or PlacementMetrics(), outputs=outputs)
