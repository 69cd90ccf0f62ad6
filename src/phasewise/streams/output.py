"""What a worker writes, and the order in which it becomes durable.

:class:`OutputSender` sends every output record through one confluent-kafka producer;
:class:`DeferredWrites` holds table state for the next commit; :class:`CommitBarrier`, run before
every Faust offset commit (:func:`attach`), waits until the outputs are delivered, then writes the
held state and waits for its changelog records: when an offset is committed, what its record caused is
on its topics and in the changelog. :class:`JobStateTable` is a job agent's table. Narrative:
docs/worker.md, "What is durable when".
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException

__all__ = ["RECORD_ERRORS", "changelog_producer", "CommitBarrier", "DeferredWrites", "DeliveryFailed",
           "JobStateTable", "OutputSender", "PartitionMap", "WorkerFailed", "attach", "output_producer",
           "record_refusal", "state_bytes"]

log = logging.getLogger(__name__)


class DeliveryFailed(RuntimeError):
    """An output record was not delivered; source offsets must not be committed."""


class WorkerFailed(RuntimeError):
    """An agent died (:meth:`CommitBarrier.fail`); source offsets must not be committed."""


#: librdkafka / broker errors about the record itself, not the broker or the network: sent again, it is
#: refused again (a record larger than ``message.max.bytes`` here or at the broker, an invalid record)
RECORD_ERRORS = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE,
                           KafkaError.INVALID_RECORD, KafkaError.INVALID_MSG_SIZE, KafkaError.INVALID_MSG,
                           KafkaError.INVALID_TIMESTAMP})


def record_refusal(err: Any, topic: str, size: int) -> str | None:
    """The reason when *err* (a ``KafkaError``) refuses a record for itself (:data:`RECORD_ERRORS`), else None."""
    try:
        code = err.code()
    except AttributeError:
        return None
    if code not in RECORD_ERRORS:
        return None
    return f"{topic} refused a record of {size} bytes: {err.str()}"


class _Epoch:
    """Records sent between two flushes; librdkafka's delivery callback for each of them."""

    __slots__ = ("outstanding", "sender")

    def __init__(self, sender: OutputSender) -> None:
        self.outstanding = 0
        self.sender = sender

    def __call__(self, err: Any, msg: Any) -> None:
        self.outstanding -= 1
        if err is not None:
            self.sender._on_error(err, msg)


class _Refusable:
    """The delivery callback of a record sent with an ``on_refused`` handler."""

    __slots__ = ("epoch", "on_refused")

    def __init__(self, epoch: _Epoch, on_refused: Callable[[str], None]) -> None:
        self.epoch = epoch
        self.on_refused = on_refused

    def __call__(self, err: Any, msg: Any) -> None:
        self.epoch.outstanding -= 1
        if err is None:
            return
        why = record_refusal(err, msg.topic() if msg is not None else "?", len(msg.value() or b"") if msg else 0)
        if why is None:
            self.epoch.sender._on_error(err, msg)
        else:
            self.epoch.sender._refused(why, self.on_refused)


def output_producer(settings: Any) -> Any:
    """The confluent-kafka producer for the worker's outputs.

    Keys are hashed with murmur2 as Faust / aiokafka / Java clients do, so a
    host's decisions land on the partition they always did, the one its
    actuator reads (:mod:`phasewise.kit.kafka.partitions`).
    """
    from phasewise.kit.kafka.client import make_producer
    from phasewise.kit.kafka.partitions import PARTITIONER

    return make_producer(settings, **{"linger.ms": 2, "partitioner": PARTITIONER,
                                      "message.timeout.ms": 60000})


def changelog_producer(settings: Any) -> Any:
    """The confluent-kafka producer for the worker's table changelogs (its own connection: a commit's
    burst of state records does not queue the next decisions behind it)."""
    from phasewise.kit.kafka.client import make_producer

    return make_producer(settings, **{"linger.ms": 2, "message.timeout.ms": 60000})


class OutputSender:
    """Sends records through one confluent-kafka *producer* and tracks their delivery.

    Call :meth:`send` from the event loop thread only (delivery callbacks run in
    :meth:`poll` / :meth:`flush` on that thread). *metrics*: an object with a
    ``delivery_errors`` counter labelled by ``topic`` (optional).
    """

    def __init__(self, producer: Any, metrics: Any = None, *, poll_interval_s: float = 0.002) -> None:
        self.producer = producer
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self._epoch = _Epoch(self)
        self._closed: list[_Epoch] = []  # epochs handed to a flush, not yet fully reported
        self.sent = 0
        self.failed = 0
        #: records refused for themselves and handed to their ``on_refused`` handler
        self.refused = 0
        self.failure: str | None = None  # first delivery error; sticky

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: list | None = None, *,
             on_refused: Callable[[str], None] | None = None, partition: int | None = None) -> None:
        """Queue one record (blocks briefly, serving deliveries, while librdkafka's queue is full).

        *on_refused*: called with the reason, instead of failing the worker, if the record is refused for
        itself (:data:`RECORD_ERRORS`), now or in its delivery report. Without it such a refusal raises
        ``KafkaException`` here, or fails every later flush.
        """
        epoch = self._epoch
        cb = epoch if on_refused is None else _Refusable(epoch, on_refused)
        extra: dict[str, Any] = {} if headers is None else {"headers": headers}
        if partition is not None:  # (a job's events: the partition its submitter's and actuator's go to)
            extra["partition"] = partition
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=cb, **extra)
                break
            except BufferError:
                self.producer.poll(0.01)
            except KafkaException as e:
                why = record_refusal(e.args[0] if e.args else None, topic, len(value or b""))
                if why is None or on_refused is None:
                    raise
                self._refused(why, on_refused)
                return
        epoch.outstanding += 1
        self.sent += 1

    def _refused(self, why: str, on_refused: Callable[[str], None]) -> None:
        self.refused += 1
        log.warning("output record refused (%s): handed to its input's handler", why)
        try:
            on_refused(why)
        except Exception as e:  # noqa: BLE001 - a handler that fails leaves the record undelivered: stop
            self.failed += 1
            if self.failure is None:
                self.failure = f"a refused record's handler failed: {type(e).__name__}: {e} ({why})"
            log.exception("the handler of a refused output record failed")

    def poll(self) -> None:
        """Serve delivery reports that arrived (non-blocking)."""
        self.producer.poll(0)

    @property
    def in_flight(self) -> int:
        return self._epoch.outstanding + sum(e.outstanding for e in self._closed)

    def _on_error(self, err: Any, msg: Any) -> None:
        topic = msg.topic() if msg is not None else "?"
        reason = f"{topic}: {err}"
        self.failed += 1
        if self.failure is None:
            self.failure = reason
        if self.metrics is not None:
            self.metrics.delivery_errors.labels(topic=topic).inc()
        log.error("output record not delivered (%s); source offsets will not be committed", reason)

    async def flush(self) -> None:
        """Wait until every record sent before this call was reported delivered.

        Raises :class:`DeliveryFailed` if any record of this process failed. What the
        ``on_refused`` handlers of records refused meanwhile sent (dead letters) is waited for too.
        """
        while True:
            refused = self.refused
            if self._epoch.outstanding:
                self._closed.append(self._epoch)
                self._epoch = _Epoch(self)
            waiting = list(self._closed)
            while True:
                self.producer.poll(0)
                if all(e.outstanding <= 0 for e in waiting):
                    break
                await asyncio.sleep(self.poll_interval_s)
            self._closed = [e for e in self._closed if e.outstanding > 0]
            if self.refused == refused:
                break
        if self.failure is not None:
            raise DeliveryFailed(f"{self.failed} output record(s) not delivered, first: {self.failure}")

    def close(self, timeout_s: float = 10.0) -> int:
        """Blocking flush for shutdown paths off the event loop; returns records still undelivered."""
        return self.producer.flush(timeout_s)


class PartitionMap:
    """The changelog partition of a table key ``host/container``.

    Faust tables are co-partitioned with their source topic: a key's state goes
    to the changelog partition of the source message it came from, i.e. the
    partition of its host's messages (samples are keyed by host). The agent
    notes it for every message; at commit time there is no current event.
    """

    def __init__(self) -> None:
        self._host: dict[str, int] = {}
        self._key: dict[str, int] = {}  # hosts whose name holds a "/": per key

    def note(self, host: str, partition: int, containers: Any = ()) -> None:
        """*host*'s messages come from *partition*; *containers*: their names (used if host has a "/")."""
        self._host[host] = partition
        if "/" in host:
            for c in containers:
                self._key[f"{host}/{c.container}"] = partition

    def of(self, key: str) -> int:
        p = self._key.get(key)
        if p is None:
            p = self._host[key[:key.index("/")]]  # the host part ends at the first "/"
        return p

    def knows(self, key: str) -> bool:
        """Whether :meth:`of` can place *key* (its host's messages were seen since the last clear)."""
        return key in self._key or key[:key.find("/")] in self._host

    def forget(self, key: str) -> None:
        """*key* is gone (expired): drop its per-key entry, if any."""
        self._key.pop(key, None)

    def clear(self) -> None:
        self._host.clear()
        self._key.clear()


_STATE_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def state_bytes(state: Any) -> bytes:
    """A container state as stored in the tables: compact JSON, the same values ``json.loads`` and the
    loaders read back.

    orjson, three times as fast as ``json.dumps`` on these states (they are serialised at every commit,
    all at once when the detectors swap models). It writes a non-finite number as ``null`` where
    ``json.dumps`` writes ``NaN``: every state's ``to_state`` writes a missing or non-finite number as
    ``None`` itself and its loader reads ``None`` back as missing, so nothing depends on the difference
    (tests/streams/test_state_bytes.py checks every state source with every array it reads non-finite).
    """
    try:
        return orjson.dumps(state, option=_STATE_OPTIONS)
    except TypeError:  # what orjson refuses, json words (or serialises, as before)
        return json.dumps(state, separators=(",", ":")).encode()


class DeferredWrites:
    """Writes to one Faust *table*, held until the next commit (latest value per key).

    *source*: called at each commit, returns ``(key, state)`` for the containers
    marked for persisting since the last call (``StateCache.pop_dirty``,
    ``PhaseFleet.pop_dirty``); their states are serialised then, once per
    container per commit however often it was marked, and written with the
    partition *partitions* gives. :meth:`put` holds one explicit write.
    :meth:`get` reads a held value first, so a loader sees its own writes.
    """

    def __init__(self, table: Any, source: Callable[[], Any] | None = None,
                 partitions: PartitionMap | None = None) -> None:
        self.table = table
        self.source = source
        self.partitions = partitions
        self._pending: dict[str, tuple[int, Any]] = {}
        self._writing: dict[str, tuple[int, Any]] = {}
        self.written = 0
        self._changelog: str | None = None  # the changelog topic's name (on the first write)
        self._last: dict[int, tuple[bytes, Any]] = {}  # partition -> the last record sent there (for seal)

    def put(self, key: str, value: Any, partition: int) -> None:
        self._pending[key] = (partition, value)

    def delete(self, key: str) -> None:
        """Hold the deletion of *key* (a changelog tombstone at the next commit)."""
        assert self.partitions is not None, "deleting needs a PartitionMap"
        self._pending[key] = (self.partitions.of(key), None)

    def get(self, key: str) -> Any:
        v = self._pending.get(key)
        if v is None:
            v = self._writing.get(key)
        return self.table.get(key) if v is None else v[1]

    def get_state(self, key: str) -> Any:
        """:meth:`get`, decoded: the container state, or None (a loader for the state caches).

        Written as JSON bytes (:func:`state_bytes`); Faust hands values recovered
        from the changelog back already decoded by its default (JSON) codec.
        """
        raw = self.get(key)
        return json.loads(raw) if isinstance(raw, (bytes, str)) else raw

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> dict[str, Any]:
        """Collect the source's marked states and hold everything for writing (synchronous).

        The garbage collector is paused meanwhile: a commit that hands out every container's state (a model
        swap) makes some twenty short-lived dicts and lists per container, acyclic (reference counting frees
        them once serialised), and each collection their count set off scanned the whole heap (10,000
        containers: 0.67 s to collect the states instead of 0.24 s, in process).
        """
        if self.source is not None:
            assert self.partitions is not None, "a source needs a PartitionMap"
            of = self.partitions.of
            paused = gc.isenabled()
            if paused:
                gc.disable()
            try:
                for k, state in self.source():
                    self._pending[k] = (of(k), state_bytes(state))
            finally:
                if paused:
                    gc.enable()
        if self._writing:  # taken again before it was written (the barrier after refused outputs): newer wins
            self._writing.update(self._pending)
            self._pending = {}
        else:
            self._writing, self._pending = self._pending, {}
        return self._writing

    def send_taken(self, sender: OutputSender) -> int:
        """Write what :meth:`take` took: the table's store and its changelog (as ``table[k] = v`` does),
        the changelog records through *sender* (a confluent-kafka producer, whose flush the barrier awaits
        next), serialised as the table's own codecs write them.

        Faust's own changelog path costs ~0.3 ms of the event loop per record (one produce request of
        its aiokafka producer each): at a commit with 1,000 marked containers, 0.3 s of stopped streams.
        Through a confluent-kafka producer a record costs a few microseconds and librdkafka batches them.
        Recovery reads the same records (key and value as the table's serialisers make them) from the
        same changelog topic and partition (see :meth:`seal`).
        """
        taken, table = self._writing, self.table
        if not taken:
            return 0
        from faust.serializers import codecs

        if self._changelog is None:
            self._changelog = table.changelog_topic.get_topic_name()
        topic, serializer, data, send = self._changelog, table.key_serializer, table.data, sender.send
        last = self._last
        for k, (partition, v) in taken.items():
            if v is None:  # a deletion: drop it here, a tombstone on the changelog (as Faust's del does)
                data.pop(k, None)
            else:
                data[k] = v
            kb = codecs.dumps(serializer, k)  # the key as the table's key serialiser writes it
            send(topic, kb, v, partition=partition)
            last[partition] = (kb, v)
        n = len(taken)
        self._writing = {}
        self.written += n
        return n

    def seal(self, sender: OutputSender) -> int:
        """Send again, alone, the last record :meth:`send_taken` sent to each partition (once those were
        delivered): each changelog partition then ends with a batch of one record, which a broker that
        reports a partition's high watermark as the first offset of its last batch + 1 (the embedded Tansu
        broker) reports exactly, so that Faust's recovery reads the whole changelog. The record is the
        key's latest state already written: reading it twice changes nothing."""
        last, self._last = self._last, {}
        for partition, (kb, v) in last.items():
            sender.send(self._changelog, kb, v, partition=partition)  # (one partition each: one batch each)
        return len(last)


class CommitBarrier:
    """Runs before every Faust commit: outputs delivered, then held state written and delivered."""

    def __init__(self, sender: OutputSender, metrics: Any = None, *, changelog: OutputSender | None = None) -> None:
        self.sender = sender
        #: what sends the tables' changelog records (default: *sender*; a worker: :func:`changelog_producer`'s)
        self.changelog = changelog or sender
        self.metrics = metrics
        self.tables: list[DeferredWrites] = []
        self.partitions = PartitionMap()
        self.commits = 0
        self._lock: asyncio.Lock | None = None  # one barrier at a time (a commit and a rebalance may overlap)
        #: called (synchronously) at the start of every barrier, before the outputs' delivery is awaited:
        #: last sends that belong to this commit (e.g. held learn windows)
        self.before: list[Callable[[], None]] = []
        self.failure: str | None = None  # set by fail(); sticky

    def fail(self, reason: str) -> None:
        """Refuse every later commit (an agent died: the events it held may be acked unprocessed)."""
        if self.failure is None:
            self.failure = reason

    def table(self, table: Any, source: Callable[[], Any] | None = None) -> DeferredWrites:
        """Hold *table*'s writes for the commits; *source*: see :class:`DeferredWrites`."""
        d = DeferredWrites(table, source, self.partitions)
        self.tables.append(d)
        return d

    async def before_commit(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(f"no offsets are committed after a failure: {self.failure}")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.failure is not None:  # failed while this barrier waited for the previous one
                raise WorkerFailed(f"no offsets are committed after a failure: {self.failure}")
            for fn in self.before:
                fn()
            refused = self.sender.refused
            for d in self.tables:
                d.take()
            await self.sender.flush()  # the outputs first: state is written for outputs delivered
            if self.sender.refused != refused:  # their handlers changed state (a job forgotten): this commit's
                for fn in self.before:
                    fn()
                for d in self.tables:
                    d.take()
                await self.sender.flush()
            n = 0
            for d in self.tables:
                n += d.send_taken(self.changelog)
            await self.changelog.flush()  # the state records: delivered before the offsets are committed
            if sum(d.seal(self.changelog) for d in self.tables):
                await self.changelog.flush()
            if self.metrics is not None and n:
                self.metrics.table_writes.inc(n)
            self.commits += 1


class JobStateTable:
    """A job agent's state in a changelogged Faust table (keys: strings, values: raw bytes).

    *state* has ``writes()`` (``(key, partition, value)`` to write, taken at each commit before the
    outputs' delivery is awaited) and ``restore(items)`` (the table's items; returns how many jobs).
    The state is restored from the table on first use after the worker starts or takes partitions
    back (:meth:`ensure_restored`, called by the agents before each record); a revocation makes the
    table, restored on assignment, the truth again. *on_restored* gets the count after each restore.
    """

    def __init__(self, app: Any, barrier: CommitBarrier, name: str, *, partitions: int, help: str,
                 state: Any, on_restored: Callable[[int], None]) -> None:
        import faust

        self.table = app.Table(name, default=None, partitions=partitions,
                               schema=faust.Schema(key_type=str, key_serializer="json", value_serializer="raw"),
                               help=help)
        self.state = state
        self.on_restored = on_restored
        self.restored = False
        writes = barrier.table(self.table)

        def hold() -> None:
            for key, p, value in state.writes():
                writes.put(key, value, p)

        barrier.before.append(hold)

        @app.on_partitions_revoked.connect
        async def _forget(app: Any, revoked: Any, **kwargs: Any) -> None:
            self.restored = False

    def ensure_restored(self) -> None:
        if not self.restored:
            n = self.state.restore(list(self.table.data.items()))
            self.restored = True
            self.on_restored(n)


def attach(app: Any, barrier: CommitBarrier) -> Callable[[], Any]:
    """Make *app*'s producer flush (which Faust awaits before committing offsets) run *barrier* first.

    Returns the original flush.
    """
    producer = app.producer
    original = producer.flush
    metrics = barrier.metrics

    async def flush() -> None:
        t0 = time.perf_counter()
        await barrier.before_commit()
        await original()
        if metrics is not None:
            metrics.commit_flush_seconds.inc(time.perf_counter() - t0)

    producer.flush = flush
    return original
