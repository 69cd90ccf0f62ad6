"""A real ``--policy phase`` worker forgets a container that stopped sending samples.

After ``container_ttl_s`` of event time without a sample, the container is
dropped from memory and a tombstone goes to both changelogs (VPA state and
phase detector state), so a restarted worker does not recover it either.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.records import encode
from phasewise.kit.topics import SAMPLES
from tests.streams.test_phase_agents import Worker, msg

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def changelog_records(settings, topic: str, timeout_s: float = 10.0, with_positions: bool = False) -> list:
    """Every (key, value) on *topic* (all partitions), from the beginning; with *with_positions*,
    (key, value, partition, offset)."""
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    md = c.list_topics(topic, timeout=10)
    parts = list(md.topics[topic].partitions) if topic in md.topics and md.topics[topic].partitions else []
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out, idle_since = [], time.monotonic()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and time.monotonic() - idle_since < 2.0:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            idle_since = time.monotonic()
            key = m.key().decode().strip('"') if m.key() is not None else None
            out.append((key, m.value(), m.partition(), m.offset()) if with_positions else (key, m.value()))
    finally:
        c.close()
    return out


def test_a_container_without_samples_for_the_ttl_is_forgotten_and_tombstoned_in_both_changelogs(
        settings, tmp_path):
    worker_id = f"pwtest-expiry-{uuid.uuid4().hex[:6]}"
    host = f"h-{uuid.uuid4().hex[:6]}"
    w = Worker(settings, tmp_path, worker_id)
    # only this host: the samples topic holds other tests' hosts, whose newer event times
    # would otherwise expire these containers at once
    w.env = {**w.env, "PHASEWISE_CONTAINER_TTL_S": "20", "PHASEWISE_STATE_WRITE_INTERVAL_S": "1",
             "PHASEWISE_WORKER_HOSTS": host}
    w.start()
    p = make_producer(settings)
    t0 = time.time() - 600
    gone, kept = f"{host}/goes", f"{host}/stays"
    topics = [f"{worker_id}-{table}-changelog" for table in ("vpa-state", "phase-state")]

    def wait_changelogs(pred, what: str) -> None:
        for topic in topics:
            deadline = time.monotonic() + 40
            while True:
                last = dict(changelog_records(settings, topic))
                if pred(last):
                    break
                assert w.role is not None and w.role.alive(), w.log()[-3000:]
                assert time.monotonic() < deadline, f"{what} on {topic}: {last}"
                time.sleep(1.0)

    def send(ticks, usage_of) -> None:
        for t in ticks:
            p.produce(SAMPLES.name, key=host.encode(), value=encode(msg(host, t0 + t, usage_of(t))))
        p.flush(10)

    try:
        # 1. both containers run for 30 s of event time; their states reach both changelogs
        send(range(30), lambda t: {"stays": (0.5, 5e8), "goes": (1.0, 9e8)})
        wait_changelogs(lambda last: last.get(gone) is not None and last.get(kept) is not None,
                        "no state for both containers")
        assert w.metric("phasewise_worker_containers_expired_total") == 0
        # 2. "goes" stops; 30 s of event time later (> the 20 s TTL) it is forgotten
        send(range(30, 60), lambda t: {"stays": (0.5, 5e8)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and w.metric("phasewise_worker_containers_expired_total") < 1:
            assert w.role is not None and w.role.alive(), w.log()
            time.sleep(0.3)
        assert w.metric("phasewise_worker_containers_expired_total") == 1, w.log()[-3000:]
        assert w.metric("phasewise_worker_containers") == 1
        # ... and tombstoned in both changelogs at the next commit; "stays" keeps its state
        wait_changelogs(lambda last: gone in last and last[gone] is None and last.get(kept) is not None,
                        f"no tombstone for {gone}")
    finally:
        if w.role is not None:
            w.role.stop()
