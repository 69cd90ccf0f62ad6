"""The Kafka boundary for the confluent-kafka roles (producer, actuator, tools).

Everything here works against any Kafka-compatible cluster given by a
bootstrap address; nothing assumes the embedded broker.
"""

from __future__ import annotations

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


def publish_dead_letter(
    producer: Producer,
    *,
    source_topic: str,
    reason: str,
    payload: bytes | None,
    key: bytes | None = None,
    partition: int | None = None,
    offset: int | None = None,
) -> DeadLetter:
    dl = DeadLetter(
        ts=time.time(),
        source_topic=source_topic,
        partition=partition,
        offset=offset,
        reason=reason,
        payload=payload_text(payload),
        key=None if key is None else payload_text(key),
    )
    producer.produce(DEAD_LETTERS.name, key=key, value=encode(dl))
    log.warning("dead-lettered %s[%s]@%s: %s", source_topic, partition, offset, reason)
    return dl
