"""Each actuator reads only its host's decisions partition: the partitioner agrees with the worker's
producer, and the reading survives a rebalance (a second ``phasewise actuate`` of the host, the first one
leaving)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.kafka.partitions import partition_for
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import Actuation, Decision, decode, encode
from phasewise.kit.topics import ACTUATIONS, DECISIONS
from phasewise.streams.output import output_producer

pytestmark = [pytest.mark.broker]


def test_the_worker_producer_places_keys_where_partition_for_says(settings):
    """librdkafka's murmur2_random (the worker's output producer) and partition_for agree, key by key."""
    p = output_producer(settings)
    placed: dict[bytes, int] = {}
    keys = [f"host-{i}-{uuid.uuid4().hex[:4]}".encode() for i in range(200)] + [b"", b"a", b"\xff" * 37]

    def cb(err, msg) -> None:
        assert err is None, err
        placed[msg.key()] = msg.partition()

    for k in keys:
        p.produce(DECISIONS.name, b"{}", k, on_delivery=cb)
    assert p.flush(20) == 0
    assert len(placed) == len(keys)
    assert {k: partition_for(k, DECISIONS.partitions) for k in keys} == placed
    assert len(set(placed.values())) == DECISIONS.partitions  # every partition used: a real spread


def _other_hosts(host: str, n: int) -> list[str]:
    """*n* hosts whose decisions land on partitions other than *host*'s."""
    mine = partition_for(host.encode(), DECISIONS.partitions)
    out, i = [], 0
    while len(out) < n:
        h = f"{host}-other{i}"
        if partition_for(h.encode(), DECISIONS.partitions) != mine:
            out.append(h)
        i += 1
    return out


class Actuator:
    """``phasewise actuate --backend dry-run`` for *settings*' host, as a user starts it, with the host's data
    directory (as two pods of one host share it: a decision redelivered to the other after a rebalance is a
    duplicate in the ledger, not applied again)."""

    def __init__(self, settings, name: str) -> None:
        self.port = free_port()
        self.proc = RoleProcess("actuate", ["--backend", "dry-run"], env={
            "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_HOST": settings.host,
            "PHASEWISE_DATA_DIR": settings.data_dir, "PHASEWISE_METRICS_PORT": str(self.port)},
            log_path=Path(settings.data_dir).parent / f"{name}.log").start()

    def ignored(self) -> float:
        return scrape(f"http://127.0.0.1:{self.port}/metrics").get("phasewise_actuator_ignored_total", -1.0)

    def stop(self) -> None:
        assert self.proc.stop(30) == 0, self.proc.log_tail()


class Actuations:
    """The actuations topic from its start: the statuses of *host*'s containers, and any other host's."""

    def __init__(self, settings) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self.host = settings.host
        self.by_container: dict[str, list[str]] = {}
        self.other_hosts = 0
        self.c = make_consumer(settings, f"pwtest-acts-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(ACTUATIONS.name, q, OFFSET_BEGINNING) for q in range(ACTUATIONS.partitions)])

    def until(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.by_container}"
            m = self.c.poll(0.5)
            if m is None or m.error() is not None:
                continue
            a = decode(Actuation, m.value())
            if a.host == self.host:
                self.by_container.setdefault(a.container, []).append(a.status)
            else:
                self.other_hosts += 1

    def handled(self) -> set[str]:
        """The containers with an outcome other than a duplicate (the dry-run backend rejects containers it
        does not find under its prefix: an outcome as good as another for reading the right partition)."""
        return {c for c, st in self.by_container.items() if any(x != "duplicate" for x in st)}


def test_an_actuator_reads_only_its_hosts_partition_across_a_rebalance(settings):
    """A rolling update of one host's actuator, two real ``phasewise actuate`` processes of one group: the
    second joins (the group rebalances), the first stops; every decision of the host is handled once and no
    other host's is read."""
    host = settings.host
    others = _other_hosts(host, 5)
    p = make_producer(settings, partitioner="murmur2_random")

    def send(h: str, container: str) -> None:
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=h, container=container, action="limit",
                     policy="test", cpu_limit_cores=1.0)
        p.produce(DECISIONS.name, key=h.encode(), value=encode(d))

    acts = Actuations(settings)
    first = Actuator(settings, "first")
    second = None
    try:
        for i in range(5):
            send(host, f"a{i}")
            for h in others:
                send(h, f"x{i}")
        assert p.flush(10) == 0
        acts.until(lambda: acts.handled() == {f"a{i}" for i in range(5)}, 60, "the first batch")
        second = Actuator(settings, "second")  # same host, same group: a rolling update
        time.sleep(8)  # the group rebalances: one of the two holds the host's partition
        assert first.ignored() == 0  # no other host's decision was read
        first.stop()  # ... then the first leaves: the second must take the partition over
        for i in range(5, 10):
            send(host, f"a{i}")
            for h in others:
                send(h, f"x{i}")
        assert p.flush(10) == 0
        want = {f"a{i}" for i in range(10)}
        acts.until(lambda: acts.handled() >= want, 60, "the second batch")
        assert second.ignored() == 0
        # each handled once: a redelivery after the rebalance is a duplicate in the shared ledger
        assert {c: len([x for x in st if x != "duplicate"]) for c, st in acts.by_container.items()} == {
            c: 1 for c in want}
        assert acts.other_hosts == 0
    finally:
        for a in (first, second):
            if a is not None and a.proc.alive():
                a.proc.stop(30)
        acts.c.close()
