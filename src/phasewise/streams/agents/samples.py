"""The samples agent (``phasewise worker``): HostSamples in, limit decisions and dead letters out.

Batches of the samples topic are decoded, admitted by the intake, stepped in rounds of distinct
hosts through the VPA updater (and, with ``--policy phase``, the phase detector), and their
decisions sent through the worker's output producer; per-container state lives in the changelogged
table ``vpa-state``. :class:`SamplesAgent` holds the agent's state and steps, :func:`register` wires
it (and the priority and targets agents beside it) on the app. Narrative: docs/worker.md, "The
samples agent".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import faust

from phasewise.kit.records import (
    Decision,
    HostSamples,
    SchemaError,
    decode_host_samples,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import keyring_of
from phasewise.kit.topics import DECISIONS, PROFILES, SAMPLES
from phasewise.models.safety.guard import RULES
from phasewise.models.safety.intake import Eviction, Occupancy, event_time_problem
from phasewise.models.safety.workload import refusal_reason, unserved, without_off
from phasewise.models.vpa.state import StateCache
from phasewise.models.vpa.updater import worker_round
from phasewise.streams.agents.scaffold import worker_outputs
from phasewise.streams.config import intake_config, state_cache, updater_config
from phasewise.streams.faust_compat import hold_commits, take_batches
from phasewise.streams.metrics import WorkerMetrics
from phasewise.streams.output import OutputSender
from phasewise.streams.scorecard import LiveScorecard
from phasewise.streams.topics import worker_topics

__all__ = ["TABLE_NAME", "SamplesAgent", "register"]

log = logging.getLogger(__name__)

TABLE_NAME = "vpa-state"


def _last_sample_ts(raw: Any) -> float | None:
    """Event time of the newest sample in a stored VPA state (``None``: unreadable or none)."""
    try:
        state = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        last = state["vpa"]["l"]
        return float(last) if last is not None else None
    except (ValueError, TypeError, KeyError):
        return None


class Expiry:
    """Forgets containers with no sample for ``ttl`` seconds of event time (0: never), and those the
    intake evicts (:meth:`drop`).

    Every ``min(ttl / 8, 1 h)`` of event time (the newest seen by this worker,
    never later than its own *clock*: a host whose clock runs ahead cannot
    expire the others' containers) it drops, from memory and from both tables
    (a changelog tombstone each, written at the next commit): the containers the cache holds whose newest
    sample is older than ``newest - ttl``, the table entries never loaded since
    the last rebalance whose stored newest sample is that old, and the phase
    detector's containers by the same rule. VPA garbage-collects after 8 days.
    The intake's :class:`~phasewise.models.safety.intake.Occupancy` (*occupancy*) forgets them too.
    """

    def __init__(self, ttl: float, cache: StateCache, table: Any, writes: Any, pmap: Any, phase: Any,
                 metrics: WorkerMetrics, clock: Callable[[], float] = time.time,
                 occupancy: Occupancy | None = None) -> None:
        self.ttl = float(ttl)
        self.occupancy = occupancy
        self.clock = clock
        self.every = min(self.ttl / 8.0, 3600.0)
        self.cache, self.table, self.writes, self.pmap, self.phase, self.metrics = (
            cache, table, writes, pmap, phase, metrics)
        self.newest = -math.inf
        self.next = None
        self.hosts: set[str] = set()  # hosts whose messages came since the last rebalance

    def reset(self) -> None:
        """Partitions were revoked: sweep again at the next message, over the new assignment."""
        self.next = None
        self.hosts.clear()

    def after(self, host: str, ts: float) -> list[str]:
        """Called after each message with its host and event time; sweeps when one is due."""
        if self.ttl <= 0:
            return []
        self.hosts.add(host)
        if ts > self.newest:
            self.newest = min(ts, self.clock())  # event time from a clock running ahead counts as now
        if self.next is None:
            self.next = self.newest  # the first message after start or a rebalance sweeps
        if self.newest < self.next:
            return []
        self.next = self.newest + self.every
        return self.sweep(self.newest - self.ttl)

    def sweep(self, cutoff: float) -> list[str]:
        gone = set(self.cache.expire(cutoff))
        # entries not loaded since the last rebalance, of hosts that sent to this worker since then
        # (so in its partitions; entries of hosts that went silent before a rebalance are left)
        hosts = self.hosts
        for k in list(self.table.data.keys()):
            if k in gone or k in self.cache or k[:k.find("/")] not in hosts or not self.pmap.knows(k):
                continue
            raw = self.writes.get(k)  # a held write or deletion is newer than the table
            last = None if raw is None else _last_sample_ts(raw)
            if last is not None and last < cutoff:
                gone.add(k)
        gone_phase = set(self.phase.expire(cutoff)) if self.phase is not None else set()
        self._delete(gone, gone_phase)
        if gone or gone_phase:
            self.metrics.containers_expired.inc(len(gone | gone_phase))
            log.info("forgot %d containers with no sample for %.0f s", len(gone | gone_phase), self.ttl)
        return sorted(gone | gone_phase)

    def drop(self, keys: list[str]) -> list[str]:
        """Forget *keys* now (evicted by the intake), from memory and both tables; returns those held."""
        gone = set(self.cache.forget(keys))
        gone_phase = set(self.phase.forget(keys)) if self.phase is not None else set()
        self._delete(gone, gone_phase, tracked=False)  # the occupancy chose them: it dropped them already
        return sorted(gone | gone_phase)

    def _delete(self, gone: set[str], gone_phase: set[str], tracked: bool = True) -> None:
        """Tombstones for the containers gone from the cache (*gone*) and the detector (*gone_phase*)."""
        for k in gone:
            if self.pmap.knows(k):
                self.writes.delete(k)
        if self.phase is not None:
            self.phase.delete(k for k in gone | gone_phase if self.pmap.knows(k))
        for k in gone | gone_phase:
            self.pmap.forget(k)
        if tracked and self.occupancy is not None and gone:
            self.occupancy.forget(gone)


class Activity:
    """One INFO line per *every_s* (wall time) summing up what the agent did.

    Each decision and phase change is logged at DEBUG only: at INFO a busy
    worker would write thousands of lines per second (~15 µs each), and the
    decisions topic is the record of them.
    """

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.since = clock()
        self.messages = self.samples = self.decisions = self.evicted = 0

    def tick(self, messages: int, samples: int, containers: int) -> str | None:
        """Count a batch; returns (and logs) the summary line when one is due."""
        self.messages += messages
        self.samples += samples
        now = self.clock()
        if now - self.since < self.every_s:
            return None
        line = (f"last {now - self.since:.0f} s: {self.messages} messages, {self.samples} container samples, "
                f"{self.decisions} decisions; {containers} containers tracked"
                + (f", {self.evicted} evicted for new ones" if self.evicted else ""))
        log.info("%s", line)
        self.since, self.messages, self.samples, self.decisions, self.evicted = now, 0, 0, 0, 0
        return line


def rounds(items: list[tuple[Any, HostSamples]], key: Callable[[Any], Any] | None = None
           ) -> list[list[tuple[Any, HostSamples]]]:
    """Consecutive runs of *items* (``(event, message)``) whose containers are distinct, in order.

    A new run starts when a host repeats (its next tick must see the state the
    previous one left), and where *key* (of an item) changes; a host name
    holding a "/" gets a run of its own (its ``host/container`` keys could
    collide with another host's).
    """
    out: list[list[tuple[Any, HostSamples]]] = []
    hosts: set[str] = set()
    alone = False  # the current run holds a host with a "/"
    last = None
    for item in items:
        host = item[1].host
        slash = "/" in host
        k = None if key is None else key(item)
        if not out or alone or slash or host in hosts or k != last:
            out.append([])
            hosts = set()
        out[-1].append(item)
        hosts.add(host)
        alone, last = slash, k
    return out


def run_rounds(items: list[tuple[Any, HostSamples]], step: Callable[[list[HostSamples]], list[Decision]],
               emit: Callable[[list[Decision]], None], version: Callable[[Any], int] | None = None,
               use: Callable[[int], None] | None = None) -> list[tuple[Any, Exception]]:
    """Step each of :func:`rounds` of *items* and *emit* its decisions; returns ``(event, error)`` of failures.

    With *version* (of an item) and *use*, rounds are also split where the version changes, and each is
    stepped after ``use(its version)`` (samples read again after an assignment: the model versions that
    decided them, :mod:`phasewise.models.phases.pinning`). A round whose step raises is stepped again
    message by message, so only the message(s) that fail are returned (to be dead-lettered) and the
    others are processed. A container the failed round had already learned learns that sample once more
    (a repeated histogram sample; harmless).
    """
    failed: list[tuple[Any, Exception]] = []
    for rnd in rounds(items, version):
        if version is not None and use is not None:
            use(version(rnd[0]))
        try:
            emit(step([hs for _, hs in rnd]))
            continue
        except Exception as e:
            if len(rnd) == 1:
                log.exception("processing a valid HostSamples message failed")
                failed.append((rnd[0][0], e))
                continue
            log.exception("processing %d messages together failed; processing them one by one", len(rnd))
        for event, hs in rnd:
            try:
                emit(step([hs]))
            except Exception as e1:
                log.exception("processing a valid HostSamples message failed")
                failed.append((event, e1))
    return failed


class SamplesAgent:
    """The samples agent on one app: its table, the VPA state cache, the intake, expiry, the scorecard,
    the phase detector and the job agents it feeds, and the step of one batch (:meth:`batch`)."""

    def __init__(self, app: faust.App, settings: Settings, *, samples_partitions: int | None = None,
                 metrics: WorkerMetrics | None = None, outputs: OutputSender | None = None,
                 views: dict[str, Any] | None = None) -> None:
        if metrics is None:
            from prometheus_client import CollectorRegistry

            metrics = WorkerMetrics(CollectorRegistry())
        self.metrics = metrics
        self.app = app
        self.topics = worker_topics(app, samples_partitions)
        partitions = samples_partitions or settings.kafka.topic_partitions or SAMPLES.partitions
        # values are the compact JSON of ContainerEntry.to_state(), kept as bytes:
        # a few hundred bytes per container in memory and on the changelog
        self.table = app.Table(TABLE_NAME, default=None, partitions=partitions,
                               schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                               help="per-container VPA recommender state (key: host/container)")
        self.outputs, self.barrier, self.dead_letter = outputs, barrier, dead_letter = worker_outputs(
            app, settings, metrics, outputs)
        # marked states, collected at each commit
        interval = settings.worker.state_write_interval_s
        self.writes = writes = barrier.table(self.table, lambda: self.take_states(interval))
        self.pmap = barrier.partitions
        # a state held for the next commit is newer than the table's
        self.cache = cache = state_cache(settings, loader=writes.get_state)

        self.phase = None  # --policy phase or --phase-workloads: the phase detector runs after the VPA (its fallback)
        self.pin_due = True  # the phase detector learns its partitions' model version at the next batch
        self.served = served = settings.worker.served_policies()
        if "phase" in served:
            from phasewise.streams.agents.phases import register_phase

            self.phase = register_phase(app, settings, vpa_cache=cache, partitions=partitions, metrics=metrics,
                                        dead_letter=dead_letter, outputs=outputs, barrier=barrier)
            self.phase.committed = self.committed_offsets
        # exact recovery: no sample offset is committed before the state that learned it is stored
        hold_commits(app, self.topics.samples.get_topic_name(), cache.hold_back)
        self.keyring = keyring = keyring_of(settings)  # signs the decisions (signing_key_file; None: unsigned)
        job_wiring = {"metrics": metrics, "outputs": outputs, "barrier": barrier, "dead_letter": dead_letter,
                      "keyring": keyring}
        if settings.priority.agent:  # DynamoML preemption over the job events
            from phasewise.streams.agents.priorities import register_priorities

            register_priorities(app, settings, **job_wiring)
        if settings.autoscale.enabled:  # DynamoML autoscaling: inference replicas from each service's SLO
            from phasewise.streams.agents.autoscaler import register_autoscaler

            register_autoscaler(app, settings, **job_wiring)
        #: --targets: the TRADL targets agent on job events, fed the admitted samples here
        self.targets: Callable[[HostSamples], None] | None = None
        if settings.targets.enabled:
            from phasewise.streams.agents.targets import register_targets

            self.targets = register_targets(app, settings, **job_wiring)

        self.only_hosts = settings.worker.host_set()
        self.intake = intake_config(settings)
        # the containers held, least recently seen first: who makes room for a new one
        self.occupancy = Occupancy(self.intake)
        self.expiry = Expiry(settings.worker.container_ttl_s, cache, self.table, writes, self.pmap, self.phase,
                             metrics, occupancy=self.occupancy)
        self.scorecard = live_scorecard(app, settings, metrics, cache, self.phase, views)
        if self.phase is not None:  # the phase decisions of containers decided with the VPA feed the scorecard alone
            self.phase.hooks.keep_shadow = self.scorecard is not None
        self.activity = Activity()
        self.default_policy = settings.worker.policy
        self.refused_logged: set[str] = set()  # containers whose refusal was logged (once each; bounded)
        self.guard = cache.guard
        self.guard_seen = [0] * len(RULES)  # the rules' counts already added to the metric
        self.batch_max = max(1, settings.worker.batch_max)
        self.batch_wait_s = max(0.0, settings.worker.batch_wait_ms) / 1000.0
        self.updater = updater_config(settings)
        self.newest: dict[str, float] = {}  # event time of the newest admitted sample per host
        self.evict_warned = -math.inf  # monotonic time of the last eviction warning (one a minute at most)
        #: every worker's profiles of signed runs, for the known-job priors (None: priors off)
        self.profiles = self._follow_profiles(app, settings) if cache.priors is not None else None

    def _follow_profiles(self, app: faust.App, settings: Settings) -> Any:
        """The profiles follower, started with the worker (other workers' runs; its own are learned at once)."""
        from phasewise.kit.kafka.client import make_producer, publish_dead_letter
        from phasewise.streams.profiles import ProfileFollower

        dl: list[Any] = []
        metrics = self.metrics

        def on_bad(value: bytes | None, key: bytes | None, partition: int, offset: int, reason: str) -> None:
            if not dl:
                dl.append(make_producer(settings))
            publish_dead_letter(dl[0], source_topic=PROFILES.name, reason=reason, payload=value, key=key,
                                partition=partition, offset=offset, max_bytes=settings.kafka.dead_letter_max_bytes)
            dl[0].poll(0)
            metrics.dead_letters.labels(kind="schema").inc()

        follower = ProfileFollower(settings, on_bad=on_bad, keyring=self.keyring)

        @app.task
        async def _start_profiles() -> None:
            follower.start()

        @app.on_before_shutdown.connect
        async def _stop_profiles(app: Any, **kwargs: Any) -> None:
            follower.stop()

        return follower

    def refuse(self, host: str, refused: tuple[Any, ...]) -> None:
        """Containers whose workload asks for a policy this worker does not run: counted, logged once
        each, shown by ``phasewise explain``; never decided."""
        for c in refused:
            key = f"{host}/{c.container}"
            reason = refusal_reason(c, self.default_policy, self.served)
            self.metrics.policy_refused.labels(policy=c.workload.policy).inc()
            if self.scorecard is not None:
                self.scorecard.refuse(key, c, reason)
            if key not in self.refused_logged:
                if len(self.refused_logged) >= 10_000:
                    self.refused_logged.clear()
                self.refused_logged.add(key)
                log.warning("container %s refused: %s", key, reason)

    def evict(self, evicted: list[Eviction]) -> None:
        """Drop the containers the intake evicted to admit new ones: state, tables, scorecard; counted."""
        keys = [e.key for e in evicted]
        self.expiry.drop(keys)
        if self.scorecard is not None:
            self.scorecard.forget(keys)
        for limit in {e.limit for e in evicted}:
            self.metrics.containers_evicted.labels(limit=limit).inc(sum(1 for e in evicted if e.limit == limit))
        self.activity.evicted += len(evicted)
        now = time.monotonic()
        if now - self.evict_warned >= 60.0:
            self.evict_warned = now
            log.warning("evicted %d container(s) to admit new ones (counted in "
                        "phasewise_worker_containers_evicted_total, summed in the activity line): %s%s",
                        len(evicted), "; ".join(f"{e.key}: {e.reason}" for e in evicted[:3]),
                        "; ..." if len(evicted) > 3 else "")

    async def admitted(self, event: faust.types.EventT, hs: HostSamples
                       ) -> tuple[HostSamples, tuple[Any, ...]] | None:
        """*hs* with the containers the worker takes, and those whose workload asks for a policy it does
        not run (refused apart); ``None``: nothing. The intake's refusals are dead-lettered, the
        containers it evicted for new ones dropped; the workloads in mode off are left out before
        the capacity limits see them (the worker holds nothing of theirs)."""
        newest = self.newest
        problem = event_time_problem(hs.ts, now=time.time(), newest=newest.get(hs.host), config=self.intake)
        if problem is not None:
            await self.dead_letter(event, problem, "event_time")
            return None
        n = len(hs.containers)
        why = self.occupancy.too_many(n)
        if why is not None:
            self.metrics.containers_refused.labels(limit="message").inc(n)
            await self.dead_letter(event, why, "capacity")
            return None
        hs = without_off(hs)  # workloads in mode off: nothing is decided for them
        hs, other_policy = unserved(hs, self.default_policy, self.served)  # a policy this worker does not run
        r = self.occupancy.admit(hs.host, [c.container for c in hs.containers])
        if r.evicted:
            self.evict(r.evicted)
        if r.refused:
            self.metrics.containers_refused.labels(limit=r.limit).inc(len(r.refused))
            shown = ", ".join(r.refused[:5]) + (", ..." if len(r.refused) > 5 else "")
            await self.dead_letter(event, f"{len(r.refused)} of {n} containers refused ({shown}): {r.why}",
                                   "capacity")
            keep = set(r.kept)
            hs = dataclasses.replace(hs, containers=tuple(c for c in hs.containers if c.container in keep))
        if len(r.refused) < n:
            if hs.ts > newest.get(hs.host, -math.inf):
                newest[hs.host] = hs.ts
            if len(newest) > 2 * len(self.cache) + 1024:  # hosts gone from the cache (expired, revoked)
                for h in [h for h in newest if not self.cache.host_count(h)]:
                    del newest[h]
        return hs, other_policy

    def process_round(self, msgs: list[HostSamples]) -> list[Decision]:
        """The VPA, then (--policy phase) the detector, over messages whose containers are distinct."""
        return worker_round(self.cache, msgs, self.updater, self.phase, self.scorecard)

    def emit(self, decisions: list[Decision]) -> None:
        if self.phase is not None:
            self.phase.flush()
        if self.cache.profiles:
            self.publish_profiles()
        if decisions:
            outputs, keyring = self.outputs, self.keyring
            for d in decisions:
                key, value = d.host.encode(), encode(d)
                outputs.send(DECISIONS.name, key, value,
                             None if keyring is None else keyring.headers(DECISIONS.name, key, value))
                log.debug("decision %s %s/%s: %s", d.id, d.host, d.container, d.reason)
            self.metrics.decisions.inc(len(decisions))
            self.metrics.decided(decisions)
            self.activity.decisions += len(decisions)

    def publish_profiles(self) -> None:
        """The signed runs' profiles the step made, to ``phasewise.profiles.v1`` (key: ``host/container``)."""
        outputs, keyring = self.outputs, self.keyring
        profiles = self.cache.pop_profiles()
        for p in profiles:
            key, value = f"{p.host}/{p.container}".encode(), encode(p)
            outputs.send(PROFILES.name, key, value,
                         None if keyring is None else keyring.headers(PROFILES.name, key, value))
        self.metrics.profiles.labels(way="published").inc(len(profiles))

    async def decoded(self, events: list[faust.types.EventT]) -> list[tuple[faust.types.EventT, HostSamples]]:
        """The batch's messages decoded and admitted (the others dead-lettered or skipped), the targets agent
        fed, each message's partition noted for its states' changelog records."""
        got: list[tuple[faust.types.EventT, HostSamples]] = []
        cache, targets, only_hosts = self.cache, self.targets, self.only_hosts
        for event in events:
            try:
                hs = decode_host_samples(event.message.value)
            except SchemaError as e:
                await self.dead_letter(event, str(e), "schema")
                continue
            except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops the agent
                log.exception("decoding a samples record failed")
                await self.dead_letter(event, f"could not decode: {type(e).__name__}: {e}", "schema")
                continue
            if only_hosts and hs.host not in only_hosts:
                continue  # another worker's hosts (PHASEWISE_WORKER_HOSTS)
            took = await self.admitted(event, hs)
            if took is None:
                continue
            hs, refused = took
            if targets is not None:  # the followed jobs' use and the host's cores
                try:
                    targets(dataclasses.replace(hs, containers=hs.containers + refused) if refused else hs)
                except Exception:  # a bug of the targets agent must not stop the limits of every container
                    log.exception("the targets agent failed on the samples of host %s", hs.host)
            if refused:
                self.refuse(hs.host, refused)
            hs = cache.unlearned(hs, event.message.offset)  # samples its stored state already learned (a restart)
            self.pmap.note(hs.host, event.message.partition, hs.containers)  # where its states' records go
            got.append((event, hs))
        return got

    async def batch(self, events: list[faust.types.EventT]) -> None:
        """One batch of the samples topic: admitted, stepped in rounds of distinct hosts, decisions sent,
        failures dead-lettered, expiry and counters after."""
        cache, metrics = self.cache, self.metrics
        if self.pin_due and self.phase is not None:
            await self.pin_phase()
        # the batch's containers are admitted before any is processed; none seen in it is evicted
        self.occupancy.begin(time.monotonic())
        if self.profiles is not None and (book := cache.priors) is not None:
            read = self.profiles.drain()  # the runs every worker published since the last batch
            for p in read:
                book.learn(p)
            if read:
                metrics.profiles.labels(way="read").inc(len(read))
        got = await self.decoded(events)
        t0 = time.perf_counter()
        phase = self.phase
        if phase is not None and phase.pin.fence is not None:  # samples read again: each with its version
            failed = run_rounds(got, self.process_round, self.emit,
                                lambda item: phase.version_at(item[0].message.partition, item[0].message.offset),
                                phase.use_version)
        else:
            failed = run_rounds(got, self.process_round, self.emit)
        now = time.monotonic()
        for event, hs in got:  # before any await: a commit takes state and offsets together
            cache.learned(hs, event.message.offset, event.message.partition, now)
        for event, e in failed:  # a bug on valid input: keep the message, keep going
            await self.dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")
        self.outputs.poll()
        if failed:
            bad = {id(event) for event, _ in failed}
            got = [(event, hs) for event, hs in got if id(event) not in bad]
        samples = 0
        for _, hs in got:
            gone = self.expiry.after(hs.host, hs.ts)
            if gone and self.scorecard is not None:
                self.scorecard.forget(gone)
            samples += len(hs.containers)
        guard = self.guard
        if guard is not None and (totals := guard.totals.tolist()) != self.guard_seen:
            for rule, now, before in zip(RULES, totals, self.guard_seen):
                if now != before:
                    metrics.safety_bounded.labels(rule=rule).inc(now - before)
            self.guard_seen[:] = totals
        self.occupancy.settle(cache.__contains__)  # admitted but not taken (a message that failed): not held
        if self.phase is not None:  # how far each partition is processed (the model pin's fence and history)
            for event in events:
                self.phase.processed(event.message.partition, event.message.offset)
        metrics.container_samples.inc(samples)
        metrics.process_seconds.inc(time.perf_counter() - t0)
        metrics.messages.inc(len(got))
        metrics.containers.set(len(cache))
        self.activity.tick(len(got), samples, len(cache))

    def take_states(self, interval: float) -> list[tuple[str, dict]]:
        """The VPA states due at this commit (the barrier takes them before the phase table's): with the phase
        machinery, a container's VPA and phase states are written together (one source offset for both)."""
        if self.phase is None:
            return self.cache.pop_dirty(time.monotonic(), interval)
        return self.phase.hooks.pop_with(time.monotonic(), interval)

    def committed_offsets(self) -> dict[int, int | None]:
        """The samples partitions' committed offsets, by partition (as the consumer last committed them)."""
        name = self.topics.samples.get_topic_name()
        try:
            committed = dict(getattr(self.app.consumer, "_committed_offset", {}) or {})
        except Exception:  # noqa: BLE001 - no consumer (yet): nothing is dropped from the histories
            return {}
        return {tp.partition: o for tp, o in committed.items() if tp.topic == name}

    async def pin_phase(self) -> None:
        """The first batch after an assignment: the phase detector takes the model version recorded for its
        samples partitions, and the partitions' ends and committed offsets as its fence."""
        consumer = self.app.consumer
        name = self.topics.samples.get_topic_name()
        tps = [tp for tp in consumer.assignment() if tp.topic == name]
        try:
            ends = dict(await consumer.highwaters(*tps)) if tps else {}
        except Exception as e:  # noqa: BLE001 - the broker did not answer: try again at the next batch
            log.warning("could not read the samples partitions' end offsets (%s: %s): the phase detector's "
                        "model version is pinned at a later batch", type(e).__name__, e)
            return
        committed = self.committed_offsets()
        self.phase.assigned({tp.partition: int(ends.get(tp, 0) or 0) for tp in tps},
                            {tp.partition: committed.get(tp.partition) for tp in tps})
        self.pin_due = False

    def forget(self) -> None:
        """Partitions were revoked: the table, restored on assignment, is the truth from here."""
        self.expiry.reset()
        self.pin_due = True
        self.cache.clear()
        self.occupancy.clear()
        if self.phase is not None:
            self.phase.clear()
        if self.scorecard is not None:
            self.scorecard.clear()
        self.metrics.containers.set(0)


def register(app: faust.App, settings: Settings, *, samples_partitions: int | None = None,
             metrics: WorkerMetrics | None = None, outputs: OutputSender | None = None,
             views: dict[str, Any] | None = None) -> SamplesAgent:
    """Add the state table and the samples agent (and the agents it runs beside it) to *app*.

    *outputs*: where decisions, phase changes, learn windows and dead letters
    go (default: one confluent-kafka producer from *settings*); its delivery
    is awaited before every offset commit (:func:`phasewise.streams.output.attach`).
    *views*: filled with the worker's JSON views (``/scorecard/``) for its
    metrics server (:func:`phasewise.kit.observe.serve`).
    """
    agent = SamplesAgent(app, settings, samples_partitions=samples_partitions, metrics=metrics, outputs=outputs,
                         views=views)

    @app.agent(agent.topics.samples, name="phasewise.vpa-samples")
    async def on_samples(stream: faust.StreamT) -> None:
        # up to batch_max messages at a time (waiting at most batch_wait_s for them): one vectorised
        # step over many hosts' containers costs about half as much per sample as one per message
        async for events in take_batches(stream, agent.batch_max, agent.batch_wait_s):
            await agent.batch(events)

    @app.on_partitions_revoked.connect
    async def _forget(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        agent.forget()

    @app.on_rebalance_complete.connect
    async def _ready(app: faust.App, **kwargs: Any) -> None:
        agent.metrics.ready.set(0 if agent.barrier.failure is not None else 1)

    return agent


def live_scorecard(app: faust.App, settings: Settings, metrics: WorkerMetrics, cache: StateCache,
                   phase: Any, views: dict[str, Any] | None = None) -> LiveScorecard | None:
    """The worker's live scorecard (``scorecard_buckets`` 0: none): its collector on the metrics
    registry and its view at ``/scorecard/``, in *views* (the metrics server's: ``metrics_port``)
    and on Faust's web server where one runs (``web_port``, off by default)."""
    if settings.worker.scorecard_buckets <= 0:
        return None
    from phasewise.models.scoring.scorecard import ScorecardConfig

    sc = LiveScorecard(ScorecardConfig(windows_s=settings.worker.scorecard_windows_s(),
                                       buckets=settings.worker.scorecard_buckets,
                                       samples=settings.worker.scorecard_samples),
                       vpa_cache=cache, phase=phase, policy=settings.worker.policy,
                       served=settings.worker.served_policies())
    metrics.registry.register(sc)

    @app.page("/scorecard/")
    async def scorecard_view(web: Any, request: Any) -> Any:
        status, body = sc.view(request.query.get("container"))
        return web.json(body, status=status)

    if views is not None:
        views["/scorecard/"] = on_event_loop(app, lambda q: sc.view(q.get("container")))
    return sc


def on_event_loop(app: faust.App, view: Callable[[dict[str, str]], tuple[int, Any]],
                  timeout_s: float = 10.0) -> Callable[[dict[str, str]], tuple[int, Any]]:
    """*view* for another thread's server: run on the app's event loop, between two of the agent's steps
    (it reads state the samples agent changes); 503 until the app runs, or when the loop is busy longer
    than *timeout_s*."""
    import asyncio
    import concurrent.futures

    loops: list[asyncio.AbstractEventLoop] = []

    @app.task
    async def _note_loop() -> None:
        loops.append(asyncio.get_running_loop())

    async def call(q: dict[str, str]) -> tuple[int, Any]:
        return view(q)

    def run(q: dict[str, str]) -> tuple[int, Any]:
        if not loops or loops[-1].is_closed():
            return 503, {"error": "the worker is starting"}
        try:
            return asyncio.run_coroutine_threadsafe(call(q), loops[-1]).result(timeout_s)
        except concurrent.futures.TimeoutError:
            return 503, {"error": f"the worker's event loop did not answer within {timeout_s:g} s"}

    return run
