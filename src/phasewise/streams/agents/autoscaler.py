"""The autoscaler agent (``phasewise worker --autoscale``): job events and each inference service's own
Prometheus metrics in, ``scale`` decisions out.

The wiring of :class:`~phasewise.models.jobs.autoscaler.AutoscaleStep` (DynamoML's auto-scaling) in the
samples worker's app: each job event is handed to the step (which services exist, where they run); every
``autoscale_interval_s`` a timer scrapes each running service's replicas (:mod:`phasewise.streams.scrape`,
in a thread: the event loop runs on) and sends the step's ``scale`` decisions, keyed by host and signed with
the cluster key; a record it cannot take is a dead letter. State: the changelogged table ``autoscale-state``
(key: job). One worker runs ``--autoscale``. Narrative: docs/priorities.md, "Inference autoscaling".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge

from phasewise.kit.settings import Settings
from phasewise.kit.topics import JOB_EVENTS
from phasewise.models.jobs.autoscaler import AutoscaleStep, Scrape, Target
from phasewise.models.safety.intake import EventClock
from phasewise.streams.agents.scaffold import Context, JobAgent, step_outcome
from phasewise.streams.config import autoscale_step_config, intake_config, submissions
from phasewise.streams.scrape import scrape_target

__all__ = ["TABLE_NAME", "AutoscalerMetrics", "agent", "register_autoscaler", "scrape_all"]

log = logging.getLogger(__name__)

TABLE_NAME = "autoscale-state"
#: the rules a scale decision may name (the metric's labels, zero from the start)
RULES = ("utilisation", "slo", "min_replicas", "max_replicas", "max_step", "bounds")


class AutoscalerMetrics:
    """The agent's own counters, on the worker's registry."""

    def __init__(self, registry: Any) -> None:
        self.scrapes = Counter("phasewise_autoscaler_scrapes", "replica metrics endpoints scraped, by outcome",
                               ["outcome"], registry=registry)
        for o in ("ok", "error"):
            self.scrapes.labels(outcome=o)
        self.decisions = Counter("phasewise_autoscaler_decisions", "scale decisions sent, by the rule that set "
                                 "their replica count", ["rule"], registry=registry)
        for r in RULES:
            self.decisions.labels(rule=r)
        self.services = Gauge("phasewise_autoscaler_services", "inference services followed (running or not yet "
                              "started)", registry=registry)


def make_step(ctx: Context) -> AutoscaleStep:
    return AutoscaleStep(autoscale_step_config(ctx.settings), submissions(ctx.settings),
                         clock=EventClock(intake_config(ctx.settings), what="job"), now=time.time,
                         verify=ctx.verify_job_events())


def restored(ctx: Context, n: int) -> None:
    if n:
        log.info("autoscaler: restored %d service(s): %s", n, ", ".join(sorted(ctx.state.services)))


agent = JobAgent("autoscaler", TABLE_NAME,
                 "autoscaler: each inference service's signed submission, host, replicas and cool-down (key: job)",
                 state=make_step, on_restored=restored)


@agent.on(JOB_EVENTS, "phasewise.autoscaler")
async def on_job_events(ctx: Context, event: Any) -> None:
    step: AutoscaleStep = ctx.state
    await step_outcome(ctx, event, lambda m: step.handle(m.value, m.partition, m.offset, key=m.key,
                                                         headers=m.headers),
                       "the autoscaler failed on a job event")
    ctx.extras["metrics"].services.set(len(step.services))


def scrape_all(targets: list[Target], timeout_s: float, metrics: AutoscalerMetrics | None = None,
               clock: Any = time.time) -> dict[str, dict[str, Scrape | None]]:
    """Every target scraped once (blocking: run it off the event loop), by service."""
    errors: set[str] = set()

    def failed(url: str, why: str) -> None:
        if metrics is not None:
            metrics.scrapes.labels(outcome="error").inc()
        if url not in errors:
            errors.add(url)
            log.warning("autoscaler: no metrics from %s: %s", url, why)

    out = {}
    for t in targets:
        got = scrape_target(t, timeout_s, clock, failed)
        if metrics is not None:
            metrics.scrapes.labels(outcome="ok").inc(sum(1 for v in got.values() if v is not None))
        out[t.job] = got
    return out


@agent.every(1.0, "phasewise.autoscaler-scrape")
async def scrape_round(ctx: Context) -> None:
    """Every ``autoscale_interval_s``: scrape, decide, send."""
    now = time.time()
    if now < ctx.extras.get("next", 0.0):
        return
    a = ctx.settings.autoscale
    ctx.extras["next"] = now + a.interval_s
    step: AutoscaleStep = ctx.state
    targets = step.targets()
    if not targets:
        return
    metrics: AutoscalerMetrics = ctx.extras["metrics"]
    scrapes = await asyncio.to_thread(scrape_all, targets, a.scrape_timeout_s, metrics)
    for d in step.decide(time.time(), scrapes):
        ctx.send_decision(d)
        metrics.decisions.labels(rule=d.details.get("rule", "bounds")).inc()
        log.info("autoscaler: %s %s/%s to %s replicas (rule %s): %s", d.action, d.host, d.container,
                 d.details.get("replicas"), d.details.get("rule"), d.reason)
    ctx.outputs.poll()


def register_autoscaler(app: Any, settings: Settings, *, metrics: Any, outputs: Any, barrier: Any,
                        dead_letter: Any, keyring: Any) -> AutoscaleStep:
    """Add the autoscaler agent, its state table and its scrape timer to the samples worker's *app*, with its
    *outputs*, *barrier*, *dead_letter* and *keyring* (``None``: decisions unsigned, ``started`` events
    taken as they come)."""
    ctx = agent.register(app, settings, metrics=metrics, outputs=outputs, barrier=barrier,
                         dead_letter=dead_letter, keyring=keyring)
    ctx.extras["metrics"] = AutoscalerMetrics(metrics.registry)
    return ctx.state
