"""The Horus agents: job events and samples in, utilisation predictions and learned jobs out.

- **job events** (``phasewise.job-events.v1``): a ``submitted`` job's graph
  features are extracted (:mod:`phasewise.streams.horus_jobs`), the model
  predicts its four targets and a :class:`~phasewise.kit.records.UtilisationPrediction`
  goes to ``phasewise.predictions.v1`` (key: job), signed with the cluster key
  when there is one (``signing_key_file``; the placement worker then takes no
  other); ``started`` says where it runs (with a cluster key, only a
  ``started`` event signed with it, the actuator's: another is a dead
  letter); ``finished`` observes and forgets it; other kinds are skipped (never
  dead-lettered).
- **phases** (``phasewise.phases.v1``): a container's first phase change
  after its job started ends the job's loading phase (else ``horus_warmup_s`` does).
- **samples** (``phasewise.samples.v1``): the samples of a started job's
  container, after its loading phase, are averaged (:class:`~phasewise.models.horus.join.HorusJoin`);
  a job with enough steady samples is learned once, and the error of its
  prediction (absolute log error per target) goes to
  ``phasewise_horus_prediction_log_error{target}``.

A record that cannot be decoded, a ``submitted`` event without a spec, or a
spec whose graph cannot be built (unknown model or entry point, a
``module:function`` whose module is not in ``horus_model_modules``, a model
that fails to build or to run a batch, or dies, loops or allocates without
end in its child process, an absurd batch size, an unknown dataset) is a dead
letter with the reason; the agent carries on. Catalog models are built in
this process; a ``module:function`` never is (:mod:`phasewise.streams.horus_jobs`).

State: one changelogged table (``horus-state``): ``job/<id>`` holds each
job's join state, ``obs/<n>`` each learned observation (the model is
rebuilt from them, in order, when the worker starts or takes its partitions
back). Writes and predictions go through the commit barrier
(:mod:`phasewise.streams.output`): a source offset is committed only after
its predictions were delivered and its state written. One horus worker runs
per cluster (it needs every job and every host).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from typing import Any

import faust

from phasewise.kit.records import (
    Interval,
    JobEvent,
    PhaseChange,
    SchemaError,
    UtilisationPrediction,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import keyring_of
from phasewise.kit.topics import DEAD_LETTERS, JOB_EVENTS, PHASES, PREDICTIONS, SAMPLES
from phasewise.models.horus.graph_features import FeatureError, GraphFeatures
from phasewise.models.horus.join import HorusJoin, JoinConfig, Observation
from phasewise.models.horus.model import TARGETS, HorusConfig, HorusModel
from phasewise.streams.horus_jobs import BuildRules, model_key, spec_features_async, warm_up
from phasewise.streams.job_inputs import dead_letterer, event_time_gate, refused_output
from phasewise.streams.output import CommitBarrier, OutputSender, attach, output_producer
from phasewise.streams.topics import raw_topic

__all__ = ["TABLE_NAME", "HorusMetrics", "HorusState", "register_horus", "device_of"]

log = logging.getLogger(__name__)

TABLE_NAME = "horus-state"
#: node_selector keys that name a GPU model
DEVICE_KEYS = ("gpu", "gpu_model", "nvidia.com/gpu.product", "accelerator")


class HorusMetrics:
    """The horus worker's metrics (the names the commit barrier and output sender use, and its own)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Summary

        self.registry = registry = registry or CollectorRegistry()
        self.predictions = Counter("phasewise_horus_predictions", "predictions published", registry=registry)
        self.learned = Counter("phasewise_horus_jobs_learned", "jobs observed and learned", registry=registry)
        self.error = Summary("phasewise_horus_prediction_log_error",
                             "|log1p(predicted) - log1p(observed)| of learned jobs' predictions at submission",
                             ["target"], registry=registry)
        self.dead_letters = Counter("phasewise_horus_dead_letters", "records dead-lettered", ["kind"],
                                    registry=registry)
        self.delivery_errors = Counter("phasewise_horus_delivery_errors", "output records not delivered",
                                       ["topic"], registry=registry)
        for t in (PREDICTIONS, DEAD_LETTERS):  # zeros: a first error is an increase (rate() and increase() see it)
            self.delivery_errors.labels(topic=t.name)
        self.table_writes = Counter("phasewise_horus_table_writes", "state table writes", registry=registry)
        self.commit_flush_seconds = Counter("phasewise_horus_commit_flush_seconds", "seconds in commit flushes",
                                            registry=registry)
        self.jobs = Gauge("phasewise_horus_jobs", "jobs held by the join", registry=registry)
        self.model_jobs = Gauge("phasewise_horus_model_jobs", "jobs the model learned from", registry=registry)
        self.ready = Gauge("phasewise_horus_ready", "1 once partitions are assigned and state restored",
                           registry=registry)
        from phasewise.kit.observe import build_info

        self.build_info = build_info(registry, "horus")



def device_of(node_selector: dict) -> str | None:
    for k in DEVICE_KEYS:
        v = node_selector.get(k)
        if isinstance(v, str) and v:
            return v
    return None


def _value(raw: Any) -> Any:
    """A table value as written (JSON bytes) or as Faust restored it (decoded JSON)."""
    return json.loads(raw) if isinstance(raw, (bytes, str)) else raw


class HorusState:
    """The model and the join, and their table records; pure of Faust (the agents hold one)."""

    def __init__(self, settings: Settings, partitions: int) -> None:
        h = settings.horus
        self.model_config = HorusConfig(coverage=h.coverage)
        self.join_config = JoinConfig(warmup_s=h.warmup_s, min_samples=h.min_samples, observe_s=h.observe_s)
        self.partitions = partitions
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        self.writes: dict[str, tuple[int, bytes | None]] = {}  # key -> (partition, value) for the next commit
        self.seq = 0

    def partition(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.partitions

    def put(self, key: str, value: Any) -> None:
        self.writes[key] = (self.partition(key), None if value is None else json.dumps(
            value, separators=(",", ":")).encode())

    def restore(self, items: Any) -> None:
        """Rebuild from the table's ``(key, value)`` items: observations replayed in order, jobs loaded."""
        self.model = HorusModel(self.model_config)
        self.join = HorusJoin(self.join_config)
        obs, jobs = [], []
        for k, raw in items:
            if raw is None:
                continue
            if k.startswith("obs/"):
                obs.append((int(k[4:]), _value(raw)))
            elif k.startswith("job/"):
                jobs.append((k[4:], _value(raw)))
        for _, o in sorted(obs):
            self.model.learn_one(o["f"], o["o"], o.get("d"))
        self.seq = max((n for n, _ in obs), default=-1) + 1
        for job, s in jobs:
            self.join.load(job, s)
        log.info("restored %d learned jobs and %d tracked jobs", len(obs), len(jobs))

    def predict(self, event: JobEvent, f: GraphFeatures) -> UtilisationPrediction:
        """The prediction of a ``submitted`` event whose graph has features *f*; the job joins."""
        spec = event.spec
        assert spec is not None
        device = device_of(spec.node_selector) or ("cpu" if spec.requests.gpus == 0 else None)
        p = self.model.predict_one(f, device)
        key = model_key(spec.model)
        feats = f.to_dict()
        self.join.submitted(event.job, event.ts, feats, key, device, {t: p[t].mean for t in TARGETS})
        return UtilisationPrediction(
            job=event.job, ts=event.ts, model_version=self.model.jobs, device=device,
            **{t: Interval(mean=p[t].mean, lo=p[t].lo, hi=p[t].hi) for t in TARGETS},
            coverage=self.model_config.coverage, first_sight=not self.model.seen(key), features=feats)

    def learn(self, o: Observation) -> dict[str, float]:
        """Learn one observation; its prediction's absolute log error per target."""
        self.model.learn_one(o.features, o.observed, o.device)
        self.put(f"obs/{self.seq:012d}", {"f": o.features, "o": o.observed, "d": o.device, "job": o.job})
        old = self.seq - self.model_config.max_observations
        if old >= 0:
            self.put(f"obs/{old:012d}", None)
        self.seq += 1
        return {t: abs(math.log1p(o.predicted[t]) - math.log1p(v)) for t, v in o.observed.items()
                if t in o.predicted}

    def flush_join(self) -> None:
        for job, s in self.join.pop_dirty():
            self.put(f"job/{job}", s)


def register_horus(app: faust.App, settings: Settings, *, metrics: HorusMetrics | None = None,
                   outputs: OutputSender | None = None) -> dict[str, Any]:
    """Add the state table and the two agents to *app*; returns the handles."""
    from phasewise.streams.agents.samples import fail_worker_on_agent_error

    metrics = metrics or HorusMetrics()
    partitions = settings.kafka.topic_partitions or JOB_EVENTS.partitions
    jobs_topic = raw_topic(app, JOB_EVENTS, partitions)
    samples_topic = raw_topic(app, SAMPLES, settings.kafka.topic_partitions or SAMPLES.partitions)
    phases_topic = raw_topic(app, PHASES, settings.kafka.topic_partitions or PHASES.partitions)
    table = app.Table(TABLE_NAME, default=None, partitions=partitions,
                      schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                      help="horus: job join states and learned observations")
    if outputs is None:
        outputs = OutputSender(output_producer(settings), metrics)
    barrier = CommitBarrier(outputs, metrics)
    attach(app, barrier)
    state = HorusState(settings, partitions)
    rules = BuildRules.from_settings(settings)
    if rules.modules:  # the build server imports torch: at start, not at the first job
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 - the first module:function job says it again, as its reason
            log.error("the build server for horus_model_modules did not start: %s", e)
    writes = barrier.table(table)

    def hold() -> None:  # runs at each commit, before the outputs' delivery is awaited
        state.flush_join()
        for k, (p, v) in state.writes.items():
            writes.put(k, v, p)
        state.writes.clear()

    barrier.before.append(hold)
    restored = [False]

    def ensure_restored() -> None:
        if not restored[0]:
            state.restore(list(table.data.items()))
            restored[0] = True
            metrics.model_jobs.set(state.model.jobs)
            metrics.jobs.set(len(state.join))

    dead_letter = dead_letterer(settings, outputs, metrics)

    app._on_agent_error = fail_worker_on_agent_error(barrier, metrics)  # type: ignore[method-assign]
    # one stamped far ahead or behind would pin the join's windows of its job, container or host
    refused_time = event_time_gate(settings, ("job", "container", "host"), dead_letter)
    keyring = keyring_of(settings)  # signs the predictions, checks the started events (None: neither)

    def learned(observations: list[Observation]) -> None:
        for o in observations:
            for target, err in state.learn(o).items():
                metrics.error.labels(target=target).observe(err)
            metrics.learned.inc()
            log.info("learned job %s (%s): %s", o.job, o.model,
                     ", ".join(f"{t}={v:.4g}" for t, v in sorted(o.observed.items())))
        metrics.model_jobs.set(state.model.jobs)

    @app.agent(jobs_topic, name="phasewise.horus-jobs")
    async def on_jobs(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                ev = decode(JobEvent, event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            if ev.kind not in ("submitted", "started", "finished"):
                continue  # progress, priority, the priority agent's hints: not this agent's concern
            if await refused_time(event, "job", ev.job, ev.ts):
                continue
            if ev.kind == "started" and keyring is not None:
                msg = event.message
                why = keyring.verify(msg.topic, msg.key, msg.value, msg.headers)
                if why is not None:  # only the actuator that started the job says where it runs
                    await dead_letter(event, f"JobEvent started {ev.job} refused: {why}", "signature")
                    continue
            try:
                if ev.kind == "submitted":
                    if ev.spec is None:
                        raise FeatureError("a submitted event needs a spec")
                    # a catalog model here (cached); a module:function only if allowed, in a child process
                    pred = state.predict(ev, await spec_features_async(ev.spec, rules))
                    key, value = ev.job.encode(), encode(pred)
                    outputs.send(PREDICTIONS.name, key, value,
                                 None if keyring is None else keyring.headers(PREDICTIONS.name, key, value),
                                 on_refused=refused_output(dead_letter, event))
                    metrics.predictions.inc()
                elif ev.kind == "started":
                    if ev.host is None or ev.container is None:
                        raise FeatureError("a started event needs host and container")
                    state.join.started(ev.job, ev.host, ev.container, ev.ts)
                elif ev.kind == "finished":
                    obs = state.join.finished(ev.job, ev.ts)
                    learned([obs] if obs is not None else [])
            except FeatureError as e:
                await dead_letter(event, f"JobEvent {ev.kind} {ev.job}: {e}", "job")
                continue
            except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
                log.exception("processing a job event failed")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
                continue
            metrics.jobs.set(len(state.join))
            outputs.poll()

    @app.agent(phases_topic, name="phasewise.horus-phases")
    async def on_phases(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                pc = decode(PhaseChange, event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            if await refused_time(event, "container", f"{pc.host}/{pc.container}", pc.ts):
                continue
            state.join.phase_change(pc.host, pc.container, pc.ts)
            outputs.poll()

    @app.agent(samples_topic, name="phasewise.horus-samples")
    async def on_samples(stream: faust.StreamT) -> None:
        async for event in stream.events():
            ensure_restored()
            try:
                hs = decode_host_samples(event.message.value)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            if await refused_time(event, "host", hs.host, hs.ts):
                continue
            try:
                learned(state.join.samples(hs))
            except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
                log.exception("joining samples failed")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
            outputs.poll()

    @app.on_partitions_revoked.connect
    async def _forget(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        restored[0] = False  # the table, restored on assignment, is the truth from here

    @app.on_rebalance_complete.connect
    async def _ready(app: faust.App, **kwargs: Any) -> None:
        metrics.ready.set(0 if barrier.failure is not None else 1)

    return {"jobs": on_jobs, "phases": on_phases, "samples": on_samples, "table": table, "state": state,
            "metrics": metrics, "outputs": outputs, "barrier": barrier}
