"""Read topics as a subscriber does: every partition assigned (no consumer group, nothing committed), from
the beginning or from a time (``offsets_for_times``), to the end each partition had when reading began,
or on (*follow*).

A partition's end is where a fetch reaches it (partition EOF); a partition that returns nothing for
*timeout_s* while records are still due (a broker that stopped answering) ends the read with
:class:`ReadError`. Records stamped before *since* are skipped also where the broker cannot look a time up.
Narrative: docs/jobs.md, "Watching jobs".
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from phasewise.kit.kafka.client import kafka_log, make_consumer, wait_for_broker
from phasewise.kit.settings import Settings

__all__ = ["Message", "ReadError", "Reader"]

log = logging.getLogger(__name__)


class ReadError(RuntimeError):
    """The topics could not be read (to their end): one line says why."""


@dataclass(frozen=True, slots=True)
class Message:
    """One record as read: where it lies, its key and value as bytes, its timestamp (Unix seconds; None:
    the broker has none), its headers (a signature)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float | None
    headers: list[tuple[str, bytes]] | None = None


class Reader:
    """A reader on the cluster of *settings*; it fails with :class:`~phasewise.kit.kafka.client.BrokerUnavailable`
    when no broker answers within *timeout_s*. Close it (or use it as a context manager)."""

    def __init__(self, settings: Settings, *, timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        wait_for_broker(settings, timeout_s)
        # a group id only because librdkafka wants one: partitions are assigned, offsets never committed
        self.consumer: Consumer = make_consumer(settings, f"phasewise-view-{uuid.uuid4().hex[:12]}",
                                                **{"enable.partition.eof": True, "fetch.wait.max.ms": 100})
        self._topics: dict[str, int] | None = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.consumer.close()

    def partitions(self, topic: str) -> int | None:
        """How many partitions *topic* has; None: the cluster has no such topic. (All topics' metadata is
        asked for, never one's by name: a broker may create a topic a metadata request names.)"""
        if self._topics is None:
            try:
                md = self.consumer.list_topics(timeout=self.timeout_s)
            except KafkaException as e:
                raise ReadError(f"no topic list from {self.settings.kafka.bootstrap}: {_text(e)}") from None
            self._topics = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
        return self._topics.get(topic)

    def read(self, topics: list[str], *, since: float | None = None, follow: bool = False,
             stop: threading.Event | None = None) -> Iterator[Message]:
        """The records of *topics* (those the cluster has), from their beginning or from the first record
        stamped at or after *since* (Unix seconds), to each partition's end (*follow*: on, until *stop* is
        set). Records come in order within a partition."""
        tps = [TopicPartition(t, p) for t in topics for p in range(self.partitions(t) or 0)]
        if not tps:
            return
        starts = {(tp.topic, tp.partition): OFFSET_BEGINNING for tp in tps}
        if since is not None:
            asked = [TopicPartition(tp.topic, tp.partition, int(since * 1000)) for tp in tps]
            try:
                found = self.consumer.offsets_for_times(asked, timeout=self.timeout_s)
            except KafkaException as e:
                raise ReadError(f"no offsets for the time asked: {_text(e)}") from None
            for tp in found:  # OFFSET_END (-1): no record at or after that time
                starts[(tp.topic, tp.partition)] = OFFSET_END if tp.offset < 0 else tp.offset
        # a partition ends where a fetch reaches its end (partition EOF, also for an empty one), not at a high
        # watermark asked beforehand: a broker may report that below the last batch's records (Tansu,
        # docs/operations.md), and asking costs a round trip per partition
        due = set(starts)
        assign = [TopicPartition(t, p, off) for (t, p), off in starts.items()]
        self.consumer.assign(assign)
        klog = kafka_log(self.settings.kafka.bootstrap)
        last = time.monotonic()
        try:
            while follow or due:
                if stop is not None and stop.is_set():
                    return
                msg = self.consumer.poll(0.2)
                if msg is None:
                    if not follow and time.monotonic() - last > self.timeout_s:
                        left = ", ".join(f"{t}[{p}]" for t, p in sorted(due))
                        why = klog.outage()
                        raise ReadError(f"no records from {left} for {self.timeout_s:g} s"
                                        + (f" ({why})" if why else "") + " before their end")
                    continue
                last = time.monotonic()
                err = msg.error()
                key = (msg.topic(), msg.partition())
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        due.discard(key)
                        continue
                    if err.fatal() or not err.retriable():
                        raise ReadError(f"reading {key[0]}[{key[1]}]: {err.str()}")
                    log.debug("reading %s[%s]: %s", key[0], key[1], err.str())
                    continue
                ts_type, ts_ms = msg.timestamp()
                ts = ts_ms / 1000 if ts_type and ts_ms >= 0 else None
                if since is not None and ts is not None and ts < since:
                    continue  # before the time asked (a broker without offsets_for_times starts earlier)
                yield Message(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), ts, msg.headers())
        finally:
            self.consumer.unassign()


def _text(e: Any) -> str:
    err = e.args[0] if getattr(e, "args", None) else e
    return err.str() if isinstance(err, KafkaError) else str(err)
