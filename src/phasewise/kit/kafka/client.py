"""The Kafka boundary of the confluent-kafka roles: clients, topics, dead letters, log folding, the broker probe.

Works against any Kafka-compatible cluster given by a bootstrap address (docs/operations.md).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from phasewise.kit.records import DeadLetter, encode, payload_text
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, TOPICS, Topic

__all__ = [
    "BrokerProbe",
    "BrokerUnavailable",
    "DEAD_LETTER_MAX_BYTES",
    "FoldRepeats",
    "KafkaLog",
    "dead_letter",
    "ensure_topics",
    "kafka_log",
    "lag_by_topic",
    "listening",
    "make_admin",
    "make_producer",
    "make_consumer",
    "publish_dead_letter",
    "wait_for_broker",
]

log = logging.getLogger(__name__)

#: seconds between two lines about the same thing (an unreachable broker, a repeated client log line)
REPEAT_EVERY_S = 5.0


class BrokerUnavailable(RuntimeError):
    """Temporary: the cluster did not answer in time; retry later."""


class _Folder:
    """Admits a key at most once per *every_s*; counts what it folded in between (thread-safe)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: dict[Any, list[float]] = {}  # key -> [last admitted at, folded since]

    def admit(self, key: Any) -> tuple[bool, int]:
        """(whether to say it now, how many like it were folded since it was last said)."""
        now = self.clock()
        with self._lock:
            entry = self._seen.get(key)
            if entry is not None and now - entry[0] < self.every_s:
                entry[1] += 1
                return False, 0
            folded = int(entry[1]) if entry is not None else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 1000:  # shapes seen once long ago
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.every_s}
            return True, folded


def _shape(text: str) -> str:
    """A log line with its numbers blanked: lines that differ only in ids, ports, times fold."""
    return re.sub(r"\d+", "#", text)


class FoldRepeats(logging.Filter):
    """A log filter: a line of the same shape from the same logger at most once per *every_s*.

    For the Kafka clients' own loggers (aiokafka, Faust), which log every failed
    reconnect; the first line of a shape passes, then one per *every_s* with how
    many were folded. Records of loggers named in *keep* always pass.
    """

    def __init__(self, every_s: float = REPEAT_EVERY_S, keep: tuple[str, ...] = ("phasewise",),
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.keep = keep
        self._folder = _Folder(every_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(self.keep) or record.levelno >= logging.CRITICAL:
            return True
        say, folded = self._folder.admit((record.name, record.levelno, _shape(str(record.msg))))
        if say and folded and isinstance(record.msg, str):
            # appended to the format, not the formatted text: the arguments stay as they are
            record.msg = f"{record.msg} ({folded} more like this in the last {self._folder.every_s:g} s)"
        return say


#: librdkafka error codes that mean "no broker can be reached"
_UNREACHABLE = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}


def _reason(text: str) -> str:
    """What went wrong, without librdkafka's thread, broker and timing details.

    >>> _reason("h:9092/bootstrap: Connect to ipv4#h:9092 failed: Connection refused (after 0ms in state CONNECT)")
    'Connection refused'
    >>> _reason("[thrd:h:9092/1]: h:9092/1: Disconnected: connection closed by peer: receive 0 after POLLIN")
    'Disconnected: connection closed by peer: receive 0 after POLLIN'
    """
    text = re.sub(r"^\[thrd:[^\]]*\]: ", "", text.strip())
    text = re.sub(r"^\S+/\S+: ", "", text)
    text = re.sub(r" \(after \d+ms.*$", "", text)
    m = re.search(r" failed: (.*)$", text)
    return m.group(1) if m else text


def listening(bootstrap: str, timeout_s: float = 1.0) -> bool:
    """Does any bootstrap address accept a TCP connection? (A quiet probe: no Kafka client, no log.)"""
    for addr in bootstrap.split(","):
        host, _, port = addr.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


class KafkaLog:
    """librdkafka's log and errors (every client's ``logger`` and ``error_cb``) through Python logging.

    An unreachable broker, however many connection attempts and clients report
    it, is one warning line per :data:`REPEAT_EVERY_S` (``no Kafka broker
    answers at ...``); other lines are folded by shape the same way. Clients
    hand these over when polled, so nothing is logged from librdkafka's threads.
    One per process and bootstrap address (:func:`kafka_log`).
    """

    def __init__(self, bootstrap: str, *, every_s: float = REPEAT_EVERY_S,
                 logger: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.bootstrap = bootstrap
        self.logger = logger or logging.getLogger("phasewise.kafka.client")
        self.clock = clock
        self.every_s = every_s
        self.down_since: float | None = None
        self.reason: str | None = None
        self._said_down_at = -math.inf
        self._failed_at = -math.inf
        self._lock = threading.Lock()
        self._folder = _Folder(every_s, clock)

    # librdkafka ``logger``: confluent-kafka calls log(level, "%s [%s] %s", facility, client, message)
    def log(self, level: int, fmt: str, *args: Any) -> None:
        facility, message = (str(args[0]), str(args[-1])) if len(args) >= 3 else ("", fmt % args)
        if facility == "FAIL" or "brokers are down" in message or "Connect to" in message:
            self.unreachable(message)
            return
        self._folded(level, f"librdkafka {facility}: {message}")

    # ``error_cb``
    def error(self, err: KafkaError) -> None:
        if err.code() in _UNREACHABLE:
            self.unreachable(err.str())
            return
        self._folded(logging.ERROR if err.fatal() else logging.WARNING, f"kafka: {err.str()}")

    def unreachable(self, reason: str) -> None:
        """Note a failed contact; say so at once, then every *every_s* while it lasts."""
        now = self.clock()
        with self._lock:
            # librdkafka retries at least every 10 s (reconnect.backoff.max.ms): a longer silence
            # means the broker answered in between, so this is a new outage
            if self.down_since is None or now - self._failed_at > max(15.0, 3 * self.every_s):
                self.down_since, self.reason, self._said_down_at = now, None, -math.inf
            self._failed_at = now
            if self.reason is None or "brokers are down" not in reason:
                self.reason = _reason(reason)
            if now - self._said_down_at < self.every_s:
                return
            self._said_down_at = now
            since = now - self.down_since
        self.logger.warning("no Kafka broker answers at %s (%s)%s; retrying", self.bootstrap, self.reason,
                            f" for {since:.0f} s" if since >= 1 else "")

    def outage(self) -> str | None:
        """Why the brokers cannot be reached, while they cannot (a failure in the last 15 s); else None."""
        with self._lock:
            if self.down_since is None or self.clock() - self._failed_at > max(15.0, 3 * self.every_s):
                return None
            return self.reason or "unreachable"

    def reachable(self) -> None:
        """A call succeeded: end the outage (said once, if it was said)."""
        with self._lock:
            since, said = self.down_since, self._said_down_at > -math.inf
            self.down_since, self.reason, self._said_down_at = None, None, -math.inf
        if since is not None and said:
            self.logger.info("Kafka broker at %s answers (after %.0f s)", self.bootstrap, self.clock() - since)

    def _folded(self, level: int, text: str) -> None:
        say, folded = self._folder.admit((level, _shape(text)))
        if say:
            self.logger.log(level, "%s%s", text, f" ({folded} more like this)" if folded else "")


_logs: dict[str, KafkaLog] = {}
_logs_lock = threading.Lock()


def kafka_log(bootstrap: str) -> KafkaLog:
    """The process's :class:`KafkaLog` for *bootstrap* (shared by all its clients)."""
    with _logs_lock:
        if bootstrap not in _logs:
            _logs[bootstrap] = KafkaLog(bootstrap)
        return _logs[bootstrap]


def _client_conf(settings: Settings) -> dict[str, Any]:
    """Every confluent-kafka client's configuration: brokers, TLS and SASL, logging."""
    from phasewise.kit.kafka.security import librdkafka_conf

    klog = kafka_log(settings.kafka.bootstrap)
    return {**settings.kafka.common(), **librdkafka_conf(settings.kafka), "logger": klog, "error_cb": klog.error}


def make_admin(settings: Settings, **extra: Any) -> AdminClient:
    return AdminClient({**_client_conf(settings), **extra})


def wait_for_broker(settings: Settings, timeout_s: float | None = 30.0, *, stop: threading.Event | None = None,
                    admin: AdminClient | None = None) -> bool:
    """Block until the cluster answers: True; or *stop* is set: False (within ~0.7 s).

    While it waits, :class:`KafkaLog` says so every few seconds. *timeout_s*:
    give up with :class:`BrokerUnavailable` after this long; None = wait until
    *stop*.
    """
    admin = make_admin(settings) if admin is None else admin
    klog = kafka_log(settings.kafka.bootstrap)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = 0.5 if deadline is None else deadline - time.monotonic()
        try:
            admin.list_topics(timeout=max(0.05, min(0.5, left)))
            admin.poll(0)
            klog.reachable()
            return True
        except KafkaException as e:
            last = e
        admin.poll(0)  # hands librdkafka's log lines and errors to klog
        if stop is not None and stop.is_set():
            return False
        if deadline is not None and time.monotonic() >= deadline:
            why = klog.reason or (last.args[0].str() if last and last.args else str(last))
            raise BrokerUnavailable(f"no Kafka broker answered at {settings.kafka.bootstrap} "
                                    f"within {timeout_s:g} s ({why})")
        if stop is not None:
            stop.wait(0.2)
        else:
            time.sleep(0.2)


class BrokerProbe:
    """Whether the cluster answers now: its metadata asked every *every_s* by a daemon thread.

    For the Faust roles, whose Kafka client (aiokafka) leaves nothing a health
    check could read: their ``/readyz`` is not ready while :meth:`outage` says
    why (the last probe failed, or one of *topics* is missing, as on a broker
    that restarted without its data). It asks for every topic's metadata, not
    *topics*' own: the embedded broker creates a topic a metadata request names.
    Failures are logged through :class:`KafkaLog`, folded like every client's.
    """

    def __init__(self, settings: Settings, topics: Iterable[str] = (), *, every_s: float = 3.0,
                 timeout_s: float = 5.0) -> None:
        self.bootstrap = settings.kafka.bootstrap
        self.topics = tuple(topics)
        self.every_s = every_s
        self.timeout_s = timeout_s
        self._admin = make_admin(settings)
        self._why: str | None = "not asked yet"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> str | None:
        """Ask now; None when a broker answered with every topic of *topics*, else why not."""
        klog = kafka_log(self.bootstrap)
        try:
            md = self._admin.list_topics(timeout=self.timeout_s)
        except KafkaException as e:
            self._admin.poll(0)  # hands librdkafka's log lines and errors to klog
            err = e.args[0] if e.args else None
            why = klog.outage() or (err.str() if isinstance(err, KafkaError) else str(e))
            why = f"no Kafka broker answers at {self.bootstrap} ({why})"
        else:
            self._admin.poll(0)
            klog.reachable()
            missing = [t for t in self.topics if t not in md.topics]
            why = (f"topic {', '.join(missing)} missing on the broker at {self.bootstrap} (a broker restarted "
                   "without its data? create the topics: phasewise topics)") if missing else None
        with self._lock:
            self._why = why
        return why

    def outage(self) -> str | None:
        """Why the last probe failed; None when it succeeded."""
        with self._lock:
            return self._why

    def start(self) -> BrokerProbe:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.check()
                except Exception as e:  # noqa: BLE001 - the probe reports, it never ends the role
                    with self._lock:
                        self._why = f"broker probe failed: {type(e).__name__}: {e}"
                self._stop.wait(self.every_s)

        self._thread = threading.Thread(target=loop, name="phasewise-broker-probe", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)


def ensure_topics(settings: Settings, topics: Iterable[Topic] = TOPICS, timeout_s: float = 30.0) -> list[str]:
    """Create missing topics; existing ones are left as they are. Returns those created."""
    admin = make_admin(settings)
    wait_for_broker(settings, timeout_s, admin=admin)
    existing = set(admin.list_topics(timeout=10).topics)
    new = []
    for t in topics:
        if t.name in existing:
            continue
        n = settings.kafka.topic_partitions or t.partitions
        config = {"cleanup.policy": "compact"} if t.compacted else {}
        new.append(NewTopic(t.name, num_partitions=n, replication_factor=-1, config=config))
    created = []
    if new:
        for name, fut in admin.create_topics(new, request_timeout=timeout_s).items():
            try:
                fut.result()
                created.append(name)
            except KafkaException as e:
                err = e.args[0]
                if err.code() != KafkaError.TOPIC_ALREADY_EXISTS:  # a racing creator is fine
                    raise
    if created:
        log.info("created topics: %s", ", ".join(created))
    return created


def make_producer(settings: Settings, **extra: Any) -> Producer:
    conf = {
        **_client_conf(settings),
        "linger.ms": 5,
        "enable.idempotence": False,
        "acks": "all",
        **extra,
    }
    return Producer(conf)


def make_consumer(settings: Settings, group_id: str, **extra: Any) -> Consumer:
    conf = {
        **_client_conf(settings),
        "group.id": group_id,
        "session.timeout.ms": settings.kafka.session_timeout_ms,
        "heartbeat.interval.ms": settings.kafka.heartbeat_interval_ms,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "fetch.wait.max.ms": settings.kafka.fetch_wait_max_ms,
        **extra,
    }
    return Consumer(conf)


def lag_by_topic(stats_json: str | bytes) -> dict[str, int]:
    """Consumer lag per topic from a librdkafka statistics document (``stats_cb``).

    The sum over the partitions this consumer is assigned of their lag (high
    watermark - the consumer's position); partitions whose lag librdkafka
    does not know yet (-1) are left out, a topic with none known is left out.

    >>> lag_by_topic('{"topics": {"t": {"partitions": {"0": {"consumer_lag": 3}, '
    ...              '"1": {"consumer_lag": -1}, "-1": {"consumer_lag": -1}}}}}')
    {'t': 3}
    """
    import json

    out: dict[str, int] = {}
    for topic, t in (json.loads(stats_json).get("topics") or {}).items():
        lags = [p.get("consumer_lag", -1) for pid, p in (t.get("partitions") or {}).items() if pid != "-1"]
        known = [x for x in lags if isinstance(x, int) and x >= 0]
        if known:
            out[topic] = sum(known)
    return out


#: a dead letter's reason is cut to this many characters, its key to this many bytes
REASON_MAX_CHARS = 2000
KEY_MAX_BYTES = 1024


#: the ``dead_letter_max_bytes`` setting's default
DEAD_LETTER_MAX_BYTES: int = Settings.default("dead_letter_max_bytes")


def _head(raw: bytes, n: int) -> bytes:
    """The first *n* bytes of *raw*, not ending inside a UTF-8 character where *raw* is UTF-8 there."""
    if n >= len(raw):
        return raw
    cut = n
    for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes
        if cut > 0 and (raw[cut] & 0xC0) == 0x80:
            cut -= 1
        else:
            return raw[:cut]
    return raw[:n]  # not UTF-8 here: cut where asked


def dead_letter(
    *,
    source_topic: str,
    reason: str,
    payload: bytes | None,
    key: bytes | None = None,
    partition: int | None = None,
    offset: int | None = None,
    max_bytes: int = DEAD_LETTER_MAX_BYTES,
    ts: float | None = None,
) -> tuple[bytes | None, bytes, DeadLetter]:
    """``(record key, record value, the DeadLetter)`` of a record that could not be processed.

    Key and value together take at most *max_bytes* (``dead_letter_max_bytes``):
    a payload whose text form would not fit is cut to its first bytes (the text
    of invalid UTF-8 is up to 5x the bytes once escaped in JSON), so is a key
    longer than :data:`KEY_MAX_BYTES`, and the dead letter says so
    (``truncated``; ``payload_bytes`` is the original size). The reason is cut
    to :data:`REASON_MAX_CHARS`.

    >>> k, v, dl = dead_letter(source_topic="t", reason="bad", payload=bytes(range(256)) * 400,
    ...                        max_bytes=20_000, ts=0.0)
    >>> len(v) <= 20_000, dl.truncated, dl.payload_bytes, k
    (True, True, 102400, None)
    """
    if len(reason) > REASON_MAX_CHARS:
        reason = reason[:REASON_MAX_CHARS - 30] + f"... ({len(reason)} characters)"
    truncated = False
    if key is not None and len(key) > KEY_MAX_BYTES:
        key, truncated = _head(key, KEY_MAX_BYTES), True
    dl = DeadLetter(
        ts=time.time() if ts is None else ts,
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        reason=reason,
        payload=payload_text(payload),
        key=None if key is None else payload_text(key),
        payload_bytes=None if payload is None else len(payload),
        truncated=truncated,
    )
    budget = max_bytes - (0 if key is None else len(key))
    value = encode(dl)
    if len(value) <= budget or payload is None:
        return key, value, dl
    # cut the payload: the bytes kept shrink in proportion to the overshoot until the value fits
    empty = len(encode(dataclasses.replace(dl, payload="", truncated=True)))
    n = len(payload)
    while True:
        room = budget - empty
        per_byte = max(1.0, (len(value) - empty) / max(1, n))
        n = min(n - 1, int(room / per_byte)) if n > 0 else 0
        dl = dataclasses.replace(dl, payload=payload_text(_head(payload, max(0, n))), truncated=True)
        value = encode(dl)
        if len(value) <= budget or n <= 0:
            return key, value, dl


def publish_dead_letter(
    producer: Producer,
    *,
    source_topic: str,
    reason: str,
    payload: bytes | None,
    key: bytes | None = None,
    partition: int | None = None,
    offset: int | None = None,
    max_bytes: int = DEAD_LETTER_MAX_BYTES,
) -> DeadLetter:
    """Queue the :func:`dead_letter` of a record on the dead-letter topic (key: the record's key)."""
    key, value, dl = dead_letter(source_topic=source_topic, reason=reason, payload=payload, key=key,
                                 partition=partition, offset=offset, max_bytes=max_bytes)
    while True:
        try:
            producer.produce(DEAD_LETTERS.name, key=key, value=value)
            break
        except BufferError:  # librdkafka's queue is full: serve deliveries, then queue
            producer.poll(0.05)
    log.warning("dead-lettered %s[%s]@%s%s: %s", source_topic, partition, offset,
                " (payload truncated)" if dl.truncated else "", reason)
    return dl
