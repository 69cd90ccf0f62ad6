"""The Horus agents (``phasewise horus``): job events, phases and samples in, utilisation predictions out.

The wiring of :class:`~phasewise.models.horus.state.HorusState`: a ``submitted`` job's graph features
are extracted (:mod:`phasewise.streams.horus_jobs`: catalog models here, a ``module:function`` only in
a child process) and its prediction goes to ``phasewise.predictions.v1`` (key: job), signed with the
cluster key; a ``started`` event (signed with the cluster key, where there is one) says where it runs;
phase changes and samples feed the join, and a job with enough steady samples is learned. A record that
cannot be decoded or taken is a dead letter. State: the changelogged table ``horus-state`` (``job/<id>``,
``obs/<n>``). Narrative: docs/horus.md, "The worker".
"""

from __future__ import annotations

import logging
from typing import Any

from phasewise.kit.records import JobEvent, PhaseChange, SchemaError, decode, decode_host_samples, encode
from phasewise.kit.topics import JOB_EVENTS, PHASES, PREDICTIONS, SAMPLES
from phasewise.models.horus.graph_features import FeatureError
from phasewise.models.horus.join import Observation
from phasewise.models.horus.state import HorusState
from phasewise.streams.agents.scaffold import Context, JobAgent
from phasewise.streams.config import horus_state_config
from phasewise.streams.horus_jobs import BuildRules, spec_features_async, warm_up
from phasewise.streams.metrics import HorusMetrics

__all__ = ["TABLE_NAME", "HorusMetrics", "agent", "register_horus"]

log = logging.getLogger(__name__)

TABLE_NAME = "horus-state"


def make_state(ctx: Context) -> HorusState:
    ctx.extras["rules"] = rules = BuildRules.from_settings(ctx.settings)
    if rules.modules:  # the build server imports torch: at start, not at the first job
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 - the first module:function job says it again, as its reason
            log.error("the build server for horus_model_modules did not start: %s", e)
    return HorusState(horus_state_config(ctx.settings))


def restored(ctx: Context, n: int) -> None:
    ctx.metrics.model_jobs.set(ctx.state.model.jobs)
    ctx.metrics.jobs.set(len(ctx.state.join))


agent = JobAgent("horus", TABLE_NAME, "horus: job join states and learned observations", state=make_state,
                 # one stamped far ahead or behind would pin the join's windows of its job, container or host
                 event_time=("job", "container", "host"), on_restored=restored)


def learned(ctx: Context, observations: list[tuple[Observation, dict[str, float]]]) -> None:
    for _o, errors in observations:
        for target, err in errors.items():
            ctx.metrics.error.labels(target=target).observe(err)
        ctx.metrics.learned.inc()
    ctx.metrics.model_jobs.set(ctx.state.model.jobs)


@agent.on(JOB_EVENTS, "phasewise.horus-jobs")
async def on_jobs(ctx: Context, event: Any) -> None:
    state: HorusState = ctx.state
    try:
        ev = decode(JobEvent, event.message.value)
    except SchemaError as e:
        await ctx.dead_letter(event, str(e), "schema")
        return
    if ev.kind not in ("submitted", "started", "finished", "failed", "rejected", "lost"):
        return  # progress, priority, the priority agent's hints: not this agent's concern
    if await ctx.refused_time(event, "job", ev.job, ev.ts):
        return
    if ev.kind != "submitted" and ctx.keyring is not None:
        msg = event.message
        why = ctx.keyring.verify(msg.topic, msg.key, msg.value, msg.headers)
        if why is not None:  # only the actuator that started the job says where it runs
            await ctx.dead_letter(event, f"JobEvent {ev.kind} {ev.job} refused: {why}", "signature")
            return
    try:
        if ev.kind == "submitted":
            if ev.spec is None:
                raise FeatureError("a submitted event needs a spec")
            # a catalog model here (cached); a module:function only if allowed, in a child process
            pred = state.predict(ev, await spec_features_async(ev.spec, ctx.extras["rules"]))
            ctx.send(PREDICTIONS.name, ev.job.encode(), encode(pred), signed=True,
                     on_refused=ctx.refused_output(event))
            ctx.metrics.predictions.inc()
        elif ev.kind == "started":
            state.started(ev)
        elif ev.kind != "finished":  # failed, rejected, lost: forgotten
            state.ended(ev)
        else:
            learned(ctx, state.finished(ev))
    except FeatureError as e:
        await ctx.dead_letter(event, f"JobEvent {ev.kind} {ev.job}: {e}", "job")
        return
    except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
        log.exception("processing a job event failed")
        await ctx.dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
        return
    ctx.metrics.jobs.set(len(state.join))
    ctx.outputs.poll()


@agent.on(PHASES, "phasewise.horus-phases")
async def on_phases(ctx: Context, event: Any) -> None:
    try:
        pc = decode(PhaseChange, event.message.value)
    except SchemaError as e:
        await ctx.dead_letter(event, str(e), "schema")
        return
    if await ctx.refused_time(event, "container", f"{pc.host}/{pc.container}", pc.ts):
        return
    ctx.state.phase_change(pc)
    ctx.outputs.poll()


@agent.on(SAMPLES, "phasewise.horus-samples")
async def on_samples(ctx: Context, event: Any) -> None:
    try:
        hs = decode_host_samples(event.message.value)
    except SchemaError as e:
        await ctx.dead_letter(event, str(e), "schema")
        return
    if await ctx.refused_time(event, "host", hs.host, hs.ts):
        return
    try:
        learned(ctx, ctx.state.samples(hs))
    except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
        log.exception("joining samples failed")
        await ctx.dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
    ctx.outputs.poll()


def register_horus(app: Any, settings: Any, *, metrics: HorusMetrics | None = None, outputs: Any = None) -> Context:
    """Add the state table and the three agents to *app*."""
    return agent.register(app, settings, metrics=metrics or HorusMetrics(), outputs=outputs)
