"""The live phase path of ``phasewise worker --policy phase``: detectors, one learner, snapshots.

:func:`register_phase` adds the ``phase-state`` table, the learner agent on
``phasewise.learn-windows.v1``, the snapshot timer and the models-topic follower to the worker's app
and returns a :class:`PhaseAgents`, the handle the samples agent drives with each round
(:class:`~phasewise.models.phases.updater.PhaseHooks` is the pure step). Narrative: docs/worker.md,
"The phase path".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from phasewise.kit.records import Decision, HostSamples, ModelSnapshot, SchemaError, encode
from phasewise.kit.records.learn_batches import decode_learn_batch
from phasewise.kit.settings import Settings
from phasewise.kit.topics import LEARN_WINDOWS, MODELS, PHASES
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.learner import Learner
from phasewise.models.phases.pinning import ModelPin, record_key, record_value, recorded_history
from phasewise.models.phases.snapshots import model_name
from phasewise.models.phases.updater import PhaseHooks, PhaseOutput
from phasewise.models.vpa.state import StateCache
from phasewise.streams.config import detector_config, initial_model
from phasewise.streams.follower import SnapshotFollower

__all__ = ["TABLE_NAME", "PhaseAgents", "ensure_phase_topics", "register_phase"]

log = logging.getLogger(__name__)

#: the changelogged table of the detectors' per-container state (key: host/container)
TABLE_NAME = "phase-state"


def ensure_phase_topics(settings: Settings) -> list[str]:
    """Create the learn-windows topic with exactly one partition (whatever ``topic_partitions`` says)."""
    from phasewise.kit.kafka.client import ensure_topics

    return ensure_topics(settings.replace(topic_partitions=0), [LEARN_WINDOWS])


class PhaseAgents:
    """The phase side of a worker, as the samples agent drives it (what :func:`register_phase` returns).

    :meth:`process_many` steps the detectors over a round of messages (distinct
    hosts) and returns the decisions to publish; :meth:`flush` sends the phase
    changes and full learn batches those rounds produced; :meth:`send_learn_batch`
    sends the partial batch (run before every offset commit). The phase
    table's marked states are collected by the commit barrier at each commit.

    Attributes: :attr:`hooks` (the detectors), :attr:`learner` (trains only in
    the worker owning the learn-windows partition), :attr:`follower`,
    :attr:`table` (the Faust table) and :attr:`writes` (its writes held until
    the next commit).
    """

    def __init__(self, hooks: PhaseHooks, learner: Learner, follower: SnapshotFollower, table: Any,
                 writes: Any, outputs: Any, metrics: Any, name_key: bytes,
                 initial: Callable[[], PhaseModel] | None = None) -> None:
        self.hooks, self.learner, self.follower, self.table, self.writes = hooks, learner, follower, table, writes
        self.outputs, self.metrics, self.name_key = outputs, metrics, name_key
        #: version 0: the model a worker starts with where no snapshot exists (the shipped pretrained one, or cold)
        self.initial = initial
        self._initial: tuple[ModelSnapshot, PhaseModel] | None = None
        #: the versions the detectors decide with: per sample read again after an assignment, then one,
        #: swapped only at commits; each partition's history recorded with them
        self.pin = ModelPin(hooks.version)
        hooks.swap_on_step = False
        #: where the samples partitions' offsets were committed (the barrier's consumer: set by the samples
        #: agent), for dropping history entries no restart needs
        self.committed: Callable[[], dict[int, int | None]] = dict
        self._pending: list[PhaseOutput] = []
        #: the last round's phase decisions of containers decided with the VPA (scored, never published)
        self.shadow: list[Decision] = []

    def process_many(self, msgs: Sequence[HostSamples]) -> list[Decision]:
        """The detector over messages with distinct containers (one fleet step); their decisions."""
        out = self.hooks.process_many(msgs)
        self.shadow = out.shadow
        self.metrics.model_version.set(self.hooks.version)
        self._pending.append(out)
        return out.decisions

    def flush(self) -> None:
        """Send the phase changes and full learn batches of the rounds stepped since the last flush."""
        while self._pending:
            out = self._pending.pop(0)
            for c in out.changes:
                self.outputs.send(PHASES.name, c.container.encode(), encode(c))
                log.debug("phase change %s/%s: %s -> %s", c.host, c.container, c.old_phase, c.new_phase)
            if out.changes:
                self.metrics.phase_changes.inc(len(out.changes))
            if out.learn_batch is not None:
                self.outputs.send(LEARN_WINDOWS.name, self.name_key, out.learn_batch)

    def send_learn_batch(self) -> None:
        """Send the learn windows held so far (run before every offset commit)."""
        batch = self.hooks.take_learn_batch()
        if batch is not None:
            self.outputs.send(LEARN_WINDOWS.name, self.name_key, batch)

    def assigned(self, ends: dict[int, int], committed: dict[int, int | None]) -> None:
        """Samples partitions were assigned (*ends*: their end offsets now, *committed*: their committed
        offsets): decide each sample read again with the model version its partition's history names, and
        swap no further until they are processed to those ends (:class:`~phasewise.models.phases.pinning.
        ModelPin`)."""
        histories = {p: recorded_history(self.writes.get(record_key(p))) for p in ends}
        available = self.follower.versions() + ([0] if self.initial is not None else [])
        missing = self.pin.assigned(histories, ends, committed, available)
        if missing:
            self.metrics.model_pins.labels(outcome="unavailable").inc()
        elif any(h is not None for h in histories.values()):
            self.metrics.model_pins.labels(outcome="pinned").inc()
        log.info("samples partitions %s assigned (models recorded: %s): %s", sorted(ends),
                 {p: histories[p] for p in sorted(histories)},
                 f"deciding what they held with the recorded versions, up to offsets {self.pin.fence}"
                 if self.pin.fence else f"deciding with model v{self.hooks.version}")

    def version_at(self, partition: int, offset: int) -> int:
        """The version to decide the sample of *partition* at *offset* with (see :meth:`ModelPin.version_at`)."""
        return self.pin.version_at(partition, offset)

    def use_version(self, version: int) -> None:
        """Decide the next round with *version* (a version the pin named: one the follower keeps, or 0)."""
        if version == self.hooks.version:
            return
        got = self._snapshot(version)
        if got is None:  # gone between the pin's check and now (the follower keeps the RECENT newest)
            log.warning("model v%d is no longer kept: deciding with v%d", version, self.hooks.version)
            return
        self.hooks.use(*got)
        self.pin.version = self.hooks.version
        self.metrics.model_version.set(self.hooks.version)

    def _snapshot(self, version: int) -> tuple[ModelSnapshot, PhaseModel] | None:
        if version == 0 and self.initial is not None:
            if self._initial is None:  # built once: rounds read again may take it up many times
                self._initial = (ModelSnapshot(name=self.hooks.name, ts=0.0, version=0, payload_b64=""),
                                 self.initial())
            return self._initial
        return self.follower.version(version)

    def processed(self, partition: int, offset: int) -> None:
        self.pin.processed(partition, offset)

    def at_commit(self) -> None:
        """Before every commit (the barrier's first step): swap to a newer snapshot if one is available and no
        fence holds, and record each assigned partition whose history changed."""
        newer = self.hooks.newer()
        self.pin.version = self.hooks.version
        plan = self.pin.at_commit(None if newer is None else newer[0].version, self.committed())
        if plan.swap:
            assert newer is not None
            self.hooks.use(*newer)
            self.metrics.model_version.set(self.hooks.version)
        for p, h in plan.records.items():
            self.writes.put(record_key(p), record_value(h), p)

    def clear(self) -> None:
        """Forget every container (after a rebalance the table is the truth)."""
        self.hooks.clear()
        self.pin.clear()

    def expire(self, cutoff: float) -> list[str]:
        """Forget the detector's containers whose newest sample is older than *cutoff*."""
        return self.hooks.fleet.expire(cutoff)

    def forget(self, keys: Iterable[str]) -> list[str]:
        """Forget the detector's state of *keys* (evicted by the intake); returns those it held."""
        fleet = self.hooks.fleet
        out = [k for k in keys if k in fleet]
        for k in out:
            fleet.forget(k)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        """Delete *keys* from the phase table (at the next commit), where it holds them."""
        for k in keys:
            if self.writes.get(k) is not None:
                self.writes.delete(k)


def register_phase(app: Any, settings: Settings, *, vpa_cache: StateCache, partitions: int, metrics: Any,
                   dead_letter: Callable[..., Any], outputs: Any, barrier: Any) -> PhaseAgents:
    """Add the phase table, the learner agent, the snapshot timer and the follower to *app*.

    *outputs*: the worker's :class:`~phasewise.streams.output.OutputSender`;
    *barrier*: its :class:`~phasewise.streams.output.CommitBarrier` (the phase
    table's writes are held there until the next commit).
    Returns the :class:`PhaseAgents` the samples agent drives.
    """
    import faust

    from phasewise.kit.kafka.client import make_producer, publish_dead_letter
    from phasewise.kit.signing import keyring_of
    from phasewise.streams.topics import raw_topic

    name = model_name(settings.phase.feature_tuple())
    name_key = name.encode()
    table = app.Table(TABLE_NAME, default=None, partitions=partitions,
                      schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                      help="per-container phase detector state (key: host/container)")
    models_t = raw_topic(app, MODELS)
    learn_t = raw_topic(app, LEARN_WINDOWS, 1)
    hooks_ref: list[PhaseHooks] = []
    writes = barrier.table(table, lambda: hooks_ref[0].pop_dirty())  # marked states, collected at each commit

    dl_producer: list[Any] = []

    def on_bad(value: bytes | None, key: bytes | None, offset: int, reason: str) -> None:
        if not dl_producer:
            dl_producer.append(make_producer(settings))
        publish_dead_letter(dl_producer[0], source_topic=MODELS.name, reason=reason, payload=value,
                            key=key, partition=0, offset=offset,
                            max_bytes=settings.kafka.dead_letter_max_bytes)
        dl_producer[0].poll(0)
        metrics.dead_letters.labels(kind="schema").inc()

    def on_loaded(snap: ModelSnapshot) -> None:
        metrics.snapshot_latest.set(snap.version)

    keyring = keyring_of(settings)  # signs the snapshots, and the follower verifies them (None: off)
    follower = SnapshotFollower(settings, name, on_bad=on_bad, on_loaded=on_loaded, keyring=keyring)
    snap = follower.load_latest()
    if snap is not None:
        got = follower.latest()
        assert got is not None
        model, origin, version = got[1].clone(), f"snapshot v{snap.version}", snap.version
        learner = Learner(got[1].clone(), snap.version, snap.samples_seen)
    else:
        model, origin = initial_model(settings)
        version = 0
        learner = Learner(model.clone(), 0, 0)
    log.info("phase detector starts from %s (model %s, warm=%s)", origin, name, model.ready)
    metrics.model_version.set(version)
    follower.start()
    hooks = PhaseHooks(detector_config(settings), vpa_cache, model=model, version=version,
                       loader=writes.get_state, latest=follower.latest)
    hooks_ref.append(hooks)

    @app.agent(learn_t, name="phasewise.phase-learner")
    async def on_learn_windows(stream: Any) -> None:
        async for event in stream.events():
            got = follower.latest()
            if got is not None and learner.rebase(*got):
                log.info("learner re-based on snapshot v%d", learner.version)
            m = learner.model
            try:
                W, P, U, LV = decode_learn_batch(event.message.value, name, m.window_len, m.n_features, m.features)
            except SchemaError as e:
                await dead_letter(event, str(e), "schema")
                continue
            except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops the agent
                log.exception("decoding a learn batch failed")
                await dead_letter(event, f"could not decode: {type(e).__name__}: {e}", "schema")
                continue
            try:
                metrics.windows_learned.inc(learner.learn(W, P, U, LV))
            except Exception as e:  # noqa: BLE001 - a bug on valid input: keep the message, keep going
                log.exception("learning a valid learn batch failed")
                await dead_letter(event, f"processing failed: {type(e).__name__}: {e}", "processing")

    @app.timer(interval=settings.phase.snapshot_interval_s)
    async def publish_snapshot() -> None:
        snap = learner.snapshot(time.time())
        if snap is None:
            return
        value = encode(snap)
        await models_t.send(key=name_key, value=value,
                            headers=None if keyring is None else keyring.headers(MODELS.name, name_key, value))
        metrics.snapshots_published.inc()
        log.info("published model snapshot %s v%d (%d windows learned, warm=%s)", name, snap.version,
                 snap.samples_seen, learner.model.ready)

    @app.on_before_shutdown.connect
    async def _stop_follower(app: Any, **kwargs: Any) -> None:
        follower.stop()

    h = PhaseAgents(hooks, learner, follower, table, writes, outputs, metrics, name_key,
                    initial=lambda: initial_model(settings)[0])
    barrier.before.append(h.at_commit)  # before the tables' writes are taken: the records go with them
    barrier.before.append(h.send_learn_batch)  # a partial batch goes out with every commit
    return h
