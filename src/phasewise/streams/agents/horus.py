"""The Horus agents (``phasewise horus``): job events, phases and samples in, utilisation predictions out.

The wiring of :class:`~phasewise.models.horus.state.HorusState`: a ``submitted`` job's graph features
are extracted (:mod:`phasewise.streams.horus_jobs`: catalog models here, a ``module:function`` only in
a child process) and its prediction goes to ``phasewise.predictions.v1`` (key: job), signed with the
cluster key; a ``started`` event (signed with the cluster key, where there is one) says where it runs.
Workers sharing one ``horus_worker_id`` read the job events by job and the samples by host, so a job's
``started`` event (with its prediction), its end and every phase change are routed (signed) on the
internal topic ``phasewise.horus-routes.v1`` to the partition of their host, which the worker reading
that host's samples reads too (Faust assigns the same partitions of topics with as many partitions);
there the join averages the job's steady samples and the job is learned once, after ``horus_observe_s``
of them or at its end, whichever comes first; its prediction is published again with what was observed
and the log error. The model is shared: each learned job publishes the
observations as a signed ``ModelSnapshot`` on the compacted models topic (key ``horus/utilisation``),
and every horus worker follows that topic (:class:`HorusSnapshots`) and learns the jobs it has not. A
record that cannot be decoded or taken is a dead letter. State: the changelogged table ``horus-state``
(``job/<id>``, ``run/<id>``, ``obs/<n>``). Narrative: docs/horus.md, "The worker", "Sharing the model" and
"More than one worker".
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

from phasewise.kit.records import (
    TERMINAL_KINDS,
    JobEvent,
    ModelSnapshot,
    PhaseChange,
    SchemaError,
    brief,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.records.routes import HorusRoute
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import HORUS_ROUTES, JOB_EVENTS, MODELS, PHASES, PREDICTIONS, SAMPLES
from phasewise.models.horus.graph_features import FeatureError
from phasewise.models.horus.join import Observation
from phasewise.models.horus.snapshot import SNAPSHOT_NAME, observations_of, snapshot_of
from phasewise.models.horus.state import HorusState
from phasewise.streams.agents.scaffold import Context, JobAgent, SetupError
from phasewise.streams.config import horus_state_config, job_partitions, samples_partitions
from phasewise.streams.horus_jobs import BuildRules, spec_features_async, warm_up
from phasewise.streams.job_inputs import Input
from phasewise.streams.metrics import HorusMetrics

__all__ = ["ENDS", "TABLE_NAME", "HorusMetrics", "HorusSnapshots", "agent", "ensure_routes", "register_horus"]

log = logging.getLogger(__name__)

TABLE_NAME = "horus-state"
#: the states after which a job is learned (if it was not yet) and forgotten
ENDS = TERMINAL_KINDS | {"terminated"}
#: the states only a role with the cluster key may publish (checked where there is a key)
_SIGNED = ENDS | {"started"}
#: hosts whose samples came on another partition than their routes go to, warned about once each (at most)
_OFF_ROUTE_WARNED_MAX = 1000


def ensure_routes(settings: Settings) -> int:
    """The routes topic's partition count, the samples topic's: created with it where missing (with
    ``create_topics``); :class:`SetupError` when it cannot be used (one line)."""
    from phasewise.kit.kafka.client import ensure_topics, make_admin

    n = samples_partitions(settings)
    # every topic listed, not the routes topic by name: the embedded broker creates a topic a request names
    routes = make_admin(settings).list_topics(timeout=10).topics.get(HORUS_ROUTES.name)
    if routes is None or not routes.partitions:
        if not settings.kafka.create_topics:
            raise SetupError(f"topic {HORUS_ROUTES.name} does not exist and create_topics is off: create it "
                             f"with {n} partitions (the samples topic's)")
        ensure_topics(settings.replace(topic_partitions=n), [HORUS_ROUTES])
    elif len(routes.partitions) != n:
        raise SetupError(f"topic {HORUS_ROUTES.name} has {len(routes.partitions)} partitions and the samples topic "
                         f"{n}: they must be equal (stop the horus workers, delete it: horus creates it again)")
    if n != job_partitions(settings):
        log.warning("the samples topic has %d partitions and the job events %d: run one horus worker per "
                    "horus_worker_id (workers sharing one need equal counts)", n, job_partitions(settings))
    return n


def _owned(app: Any) -> Any:
    """``() -> the partitions of the job-events and samples topics assigned to this worker`` (None: unknown)."""
    def owned() -> set[int] | None:
        try:
            tps = app.assignor.assigned_actives()
        except Exception:  # noqa: BLE001 - no assignment to read: keep every record
            return None
        parts = {tp.partition for tp in tps if tp.topic in (JOB_EVENTS.name, SAMPLES.name)}
        return parts or None
    return owned


class HorusSnapshots:
    """The shared Horus model as the compacted models topic holds it, for one horus worker.

    Reads the topic from its beginning (:meth:`load`, at start-up) and follows it on a daemon thread;
    each snapshot of ``horus/utilisation`` (its signature checked with a keyring) is decoded there and its
    observations kept (the union, newest last, at most *keep*); one that is no usable snapshot is kept as
    a bad record for the event loop to dead-letter. The event loop takes both with :meth:`take`.
    """

    def __init__(self, settings: Settings, keyring: Keyring | None, keep: int) -> None:
        self.settings, self.keyring, self.keep = settings, keyring, keep
        self._lock = threading.Lock()
        self.union: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.version = 0
        self.generation = 0  #: accepted snapshots so far
        self.bad: deque[tuple[Input, str, str]] = deque(maxlen=100)
        self._consumer: Any = None

    def _make_consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        from phasewise.kit.kafka.client import make_consumer

        c = make_consumer(self.settings, f"{self.settings.horus.worker_id}-horus-snapshots",
                          **{"fetch.wait.max.ms": 200})
        c.assign([TopicPartition(MODELS.name, 0, OFFSET_BEGINNING)])
        return c

    def handle(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
               headers: Any) -> bool:
        """One models-topic record: whether it was a usable Horus snapshot (others' keys are skipped)."""
        if key != SNAPSHOT_NAME.encode():
            return False
        where = Input(topic, key, value, partition, offset)
        if self.keyring is not None and (why := self.keyring.verify(topic, key, value, headers)) is not None:
            self.bad.append((where, f"Horus ModelSnapshot refused: {why}", "signature"))
            return False
        try:
            snap = decode(ModelSnapshot, value)
            obs = observations_of(snap)
        except SchemaError as e:
            self.bad.append((where, str(e), "schema"))
            return False
        with self._lock:
            for o in obs:
                self.union.pop(o["job"], None)
                self.union[o["job"]] = o
            while len(self.union) > self.keep:
                self.union.popitem(last=False)
            self.version = max(self.version, snap.version)
            self.generation += 1
        log.info("Horus model snapshot v%d read: %d learned jobs", snap.version, len(obs))
        return True

    def _poll(self, timeout: float) -> None:
        m = self._consumer.poll(timeout)
        if m is not None and not m.error():
            self.handle(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.headers())

    def load(self, timeout_s: float = 10.0) -> int:
        """Read the topic to its current end (blocking); the snapshots accepted."""
        from confluent_kafka import TopicPartition

        if self._consumer is None:
            self._consumer = self._make_consumer()
        lo, hi = self._consumer.get_watermark_offsets(TopicPartition(MODELS.name, 0), timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pos = self._consumer.position([TopicPartition(MODELS.name, 0)])[0].offset
            if pos >= hi or hi <= lo:
                break
            self._poll(0.2)
        return self.generation

    def start(self) -> None:
        if self._consumer is None:
            self._consumer = self._make_consumer()
        threading.Thread(target=self._run, name="phasewise-horus-snapshots", daemon=True).start()

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the worker
            try:
                self._poll(0.5)
            except Exception:  # noqa: BLE001 - keep following; a broken record must not stop the updates
                log.exception("horus snapshots: unexpected error")

    def take(self) -> tuple[int, int, list[dict[str, Any]], list[tuple[Input, str, str]]]:
        """``(generation, newest version, the union of shared observations, bad records since the last call)``."""
        with self._lock:
            bad = list(self.bad)
            self.bad.clear()
            return self.generation, self.version, list(self.union.values()), bad


def make_state(ctx: Context) -> HorusState:
    ctx.extras["rules"] = rules = BuildRules.from_settings(ctx.settings)
    if rules.modules:  # the build server imports torch: at start, not at the first job
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 - the first module:function job says it again, as its reason
            log.error("the build server for horus_model_modules did not start: %s", e)
    ctx.extras["routes"] = ensure_routes(ctx.settings)
    ctx.extras["off_route"] = set()  # hosts warned about
    state = HorusState(horus_state_config(ctx.settings))
    state.owned = _owned(ctx.app)
    if ctx.settings.horus.share_model:
        snaps = HorusSnapshots(ctx.settings, ctx.keyring, state.model_config.max_observations)
        n = snaps.load()
        log.info("the shared Horus model: %d snapshots read", n)
        snaps.start()
        ctx.extras["snapshots"] = snaps
    ctx.extras["adopted"] = -1  # the snapshots generation merged (-1: none, or the state was restored since)
    ctx.extras["published"] = set()  # the jobs of this worker's last published snapshot
    return state


def restored(ctx: Context, n: int) -> None:
    ctx.extras["adopted"] = -1  # a restored state learns the shared observations again
    adopt(ctx)
    ctx.metrics.model_jobs.set(ctx.state.model.jobs)
    held(ctx)


def adopt(ctx: Context) -> None:
    """Learn what the other horus workers shared since the last call, dead-letter what was no snapshot, and
    share this worker's model where it holds jobs the shared one lacks."""
    snaps: HorusSnapshots | None = ctx.extras.get("snapshots")
    if snaps is None:
        return
    generation, version, union, bad = snaps.take()
    for where, reason, kind in bad:
        ctx.dead_letter.now(where, reason, kind)  # type: ignore[attr-defined]
    if generation == ctx.extras["adopted"]:
        return
    ctx.extras["adopted"] = generation
    state: HorusState = ctx.state
    n = state.merge(union, version)
    if n:
        ctx.metrics.shared_learned.inc(n)
        ctx.metrics.model_jobs.set(state.model.jobs)
        log.info("learned %d jobs from the shared Horus model v%d", n, version)
    theirs = {o["job"] for o in union} | ctx.extras["published"]
    if any(j not in theirs for j in state.kept if not j.startswith("#")):
        share(ctx)


def share(ctx: Context) -> None:
    """Publish this worker's observations as the shared model's next snapshot (signed)."""
    if ctx.extras.get("snapshots") is None:
        return
    state: HorusState = ctx.state
    state.snapshot_version += 1
    snap = snapshot_of(state.shared(), state.snapshot_version, time.time())
    ctx.send(MODELS.name, SNAPSHOT_NAME.encode(), encode(snap), signed=True,
             on_refused=lambda why: log.error("the Horus model snapshot v%d was refused: %s",
                                              snap.version, brief(why, 300)))
    ctx.extras["published"] = set(state.kept)
    ctx.metrics.snapshots.inc()


agent = JobAgent("horus", TABLE_NAME, "horus: job join states and learned observations", state=make_state,
                 # one stamped far ahead or behind would pin the join's windows of its job, container or host
                 event_time=("job", "container", "host"), on_restored=restored)


def learned(ctx: Context, observations: list[tuple[Observation, dict[str, float]]]) -> None:
    """The jobs just learned: their errors measured and published with their predictions, the model shared."""
    for o, errors in observations:
        for target, err in errors.items():
            ctx.metrics.error.labels(target=target).observe(err)
            ctx.metrics.last_error.labels(target=target).set(err)
        ctx.metrics.learned.inc()
        out = ctx.state.outcome(o, errors)
        if out is not None:
            ctx.send(PREDICTIONS.name, o.job.encode(), encode(out), signed=True,
                     on_refused=lambda why, job=o.job: log.error("the outcome of job %s was refused: %s", job,
                                                                 brief(why, 300)))
    ctx.metrics.model_jobs.set(ctx.state.model.jobs)
    if observations:
        share(ctx)


@agent.on(JOB_EVENTS, "phasewise.horus-jobs")
async def on_jobs(ctx: Context, event: Any) -> None:
    state: HorusState = ctx.state
    if (ev := await ctx.decoded(event, lambda raw: decode(JobEvent, raw))) is None:
        return
    if ev.kind != "submitted" and ev.kind not in _SIGNED:
        return  # progress, priority, the priority agent's hints: not this agent's concern
    if await ctx.refused_time(event, "job", ev.job, ev.ts):
        return
    # only the actuator that started the job says where it runs and when it ended (or the agent that lost it)
    if ev.kind in _SIGNED and await ctx.unsigned(event, f"JobEvent {ev.kind} {ev.job}"):
        return
    adopt(ctx)

    async def step() -> None:
        if ev.kind == "submitted":
            if ev.spec is None:
                raise FeatureError("a submitted event needs a spec")
            # a catalog model here (cached); a module:function only if allowed, in a child process
            pred = state.predict(ev, await spec_features_async(ev.spec, ctx.extras["rules"]))
            ctx.send(PREDICTIONS.name, ev.job.encode(), encode(pred), signed=True,
                     on_refused=ctx.refused_output(event))
            ctx.metrics.predictions.inc()
        else:  # started, or an end: to the worker reading the job's host (where it ran)
            send_route(ctx, state.started(ev) if ev.kind == "started" else state.end(ev), event)

    if not await taken(ctx, event, f"JobEvent {ev.kind} {ev.job}", "processing a job event failed", step):
        return
    ctx.count_ignored(state.lifecycle.take_counts())
    held(ctx)
    ctx.outputs.poll()


async def taken(ctx: Context, event: Any, what: str, failed: str, step: Callable[[], Awaitable[None]]) -> bool:
    """``await step()`` for *event*; whether it went through. A :class:`FeatureError` makes the event a dead
    letter of kind ``job`` (its reason after *what*), any other error one of kind ``processing`` (logged as
    *failed*: a bug on a valid record; the agent goes on)."""
    try:
        await step()
    except FeatureError as e:
        await ctx.dead_letter(event, f"{what}: {e}", "job")
        return False
    except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
        await ctx.failed(event, failed, e)
        return False
    return True


def held(ctx: Context) -> None:
    """The jobs held: booked (their events read here) and joined (their host's samples read here)."""
    ctx.metrics.jobs.set(len(ctx.state.book) + len(ctx.state.join))


def send_route(ctx: Context, route: HorusRoute | None, event: Any) -> None:
    """*route* (signed) to its host's partition of the routes topic: the samples topic's partition of that
    host (CRC32 of the key, librdkafka's default partitioner, which phasewise's producers use)."""
    if route is None:
        return
    key = route.host.encode()
    ctx.send(HORUS_ROUTES.name, key, encode(route), signed=True, on_refused=ctx.refused_output(event),
             partition=zlib.crc32(key) % ctx.extras["routes"])
    ctx.metrics.routes.labels(kind=route.kind).inc()


@agent.on(HORUS_ROUTES, "phasewise.horus-routes")
async def on_routes(ctx: Context, event: Any) -> None:
    if (r := await ctx.decoded(event, lambda raw: decode(HorusRoute, raw))) is None:
        return
    # only a horus worker routes (with the cluster key, where there is one)
    if await ctx.unsigned(event, f"HorusRoute {r.kind} {r.host}"):
        return
    async def step() -> None:
        learned(ctx, ctx.state.route(r))

    if not await taken(ctx, event, f"HorusRoute {r.kind} {r.host}", "processing a route failed", step):
        return
    held(ctx)
    ctx.outputs.poll()


@agent.on(PHASES, "phasewise.horus-phases")
async def on_phases(ctx: Context, event: Any) -> None:
    if (pc := await ctx.decoded(event, lambda raw: decode(PhaseChange, raw))) is None:
        return
    if await ctx.refused_time(event, "container", f"{pc.host}/{pc.container}", pc.ts):
        return
    send_route(ctx, HorusRoute(host=pc.host, kind="phase", ts=pc.ts, phase=pc), event)
    ctx.outputs.poll()


@agent.on(SAMPLES, "phasewise.horus-samples")
async def on_samples(ctx: Context, event: Any) -> None:
    if (hs := await ctx.decoded(event, decode_host_samples)) is None:
        return
    if await ctx.refused_time(event, "host", hs.host, hs.ts):
        return
    off_route(ctx, hs.host, event.message.partition)
    adopt(ctx)
    try:
        learned(ctx, ctx.state.samples(hs))
    except Exception as e:  # noqa: BLE001 - a bug on a valid record: keep it, keep going
        await ctx.failed(event, "joining samples failed", e)
    ctx.outputs.poll()


def off_route(ctx: Context, host: str, partition: int) -> None:
    """Count (and say once per host) samples on another partition than their host's routes: written by a
    producer whose partitioner is not CRC32 of the key, they meet their jobs only with one worker per id."""
    if partition == zlib.crc32(host.encode()) % ctx.extras["routes"]:
        return
    ctx.metrics.off_route.inc()
    warned = ctx.extras["off_route"]
    if host not in warned and len(warned) < _OFF_ROUTE_WARNED_MAX:
        warned.add(host)
        log.warning("samples of host %s came on partition %d, its routes go to %d (CRC32 of the key): with more "
                    "than one horus worker per horus_worker_id its jobs are not learned; produce the samples "
                    "with librdkafka's default partitioner (phasewise produce does)", host, partition,
                    zlib.crc32(host.encode()) % ctx.extras["routes"])


@agent.every(1.0, "phasewise.horus-shared-model")
async def follow_shared_model(ctx: Context) -> None:
    """What other horus workers learned, merged between records too."""
    adopt(ctx)
    ctx.outputs.poll()


def register_horus(app: Any, settings: Any, *, metrics: HorusMetrics | None = None, outputs: Any = None) -> Context:
    """Add the state table and the four agents to *app*."""
    return agent.register(app, settings, metrics=metrics or HorusMetrics(), outputs=outputs)
