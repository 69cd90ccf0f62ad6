"""The Kafka boundary for the confluent-kafka roles (producer, actuator, tools).

Everything here works against any Kafka-compatible cluster given by a
bootstrap address; nothing assumes the embedded broker.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from phasewise.schemas import DeadLetter, encode, payload_text
from phasewise.settings import Settings
from phasewise.topics import DEAD_LETTERS, TOPICS, Topic

__all__ = [
    "BrokerUnavailable",
    "DEAD_LETTER_MAX_BYTES",
    "dead_letter",
    "ensure_topics",
    "make_producer",
    "make_consumer",
    "publish_dead_letter",
    "wait_for_broker",
]

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """Temporary: the cluster did not answer in time; retry later."""


def wait_for_broker(settings: Settings, timeout_s: float = 30.0) -> None:
    admin = AdminClient(settings.kafka_common())
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=2)
            return
        except KafkaException as e:
            last = e
            time.sleep(0.2)
    raise BrokerUnavailable(f"no Kafka broker answered at {settings.bootstrap} within {timeout_s:.0f}s: {last}")


def ensure_topics(settings: Settings, topics: Iterable[Topic] = TOPICS, timeout_s: float = 30.0) -> list[str]:
    """Create missing topics; existing ones are left as they are. Returns those created."""
    admin = AdminClient(settings.kafka_common())
    wait_for_broker(settings, timeout_s)
    existing = set(admin.list_topics(timeout=10).topics)
    new = []
    for t in topics:
        if t.name in existing:
            continue
        n = settings.topic_partitions or t.partitions
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
        **settings.kafka_common(),
        "linger.ms": 5,
        "enable.idempotence": False,
        "acks": "all",
        **extra,
    }
    return Producer(conf)


def make_consumer(settings: Settings, group_id: str, **extra: Any) -> Consumer:
    conf = {
        **settings.kafka_common(),
        "group.id": group_id,
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": settings.heartbeat_interval_ms,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "fetch.wait.max.ms": settings.fetch_wait_max_ms,
        **extra,
    }
    return Consumer(conf)


#: a dead letter's reason is cut to this many characters, its key to this many bytes
REASON_MAX_CHARS = 2000
KEY_MAX_BYTES = 1024


#: ``Settings().dead_letter_max_bytes``
DEAD_LETTER_MAX_BYTES: int = next(f.default for f in dataclasses.fields(Settings)
                                  if f.name == "dead_letter_max_bytes")


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
