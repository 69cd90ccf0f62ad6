"""Each actuator reads only its host's decisions partition: the partitioner agrees with the worker's
producer, and the reading survives a rebalance (a second actuator of the host, the first one leaving)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.consumer import run_actuator
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.kafka.client import make_producer
from phasewise.kit.kafka.partitions import partition_for
from phasewise.kit.records import Decision, encode
from phasewise.kit.topics import DECISIONS
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


class Running:
    """An actuator of *settings*' host on a thread, with the host's ledger file (as two pods of one host share
    its data directory: a decision redelivered to the other after a rebalance is a duplicate, not applied)."""

    def __init__(self, settings) -> None:
        self.metrics = ActuatorMetrics(CollectorRegistry())
        self.backend = DryRunBackend()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        ledger = Ledger(Path(settings.data_dir) / "ledger.sqlite")

        def go() -> None:
            try:
                run_actuator(settings, self.backend, self.stop, metrics=self.metrics, ledger=ledger, host_cores=4.0)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors.append(e)
        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def applied(self) -> set[str]:
        return {c.container for c in self.backend.commands}

    def ignored(self) -> float:
        return self.metrics.registry.get_sample_value("phasewise_actuator_ignored_total")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.errors, self.errors


def wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_an_actuator_reads_only_its_hosts_partition_across_a_rebalance(settings):
    host = settings.host
    others = _other_hosts(host, 5)
    p = make_producer(settings, partitioner="murmur2_random")

    def send(h: str, container: str) -> None:
        d = Decision(id=uuid.uuid4().hex, ts=time.time(), host=h, container=container, action="limit",
                     policy="test", cpu_limit_cores=1.0)
        p.produce(DECISIONS.name, key=h.encode(), value=encode(d))

    first = Running(settings)
    try:
        for i in range(5):
            send(host, f"a{i}")
            for h in others:
                send(h, f"x{i}")
        assert p.flush(10) == 0
        wait(lambda: first.applied() == {f"a{i}" for i in range(5)}, 40, "the first batch")
        second = Running(settings)  # same host, same group: a rolling update
        try:
            time.sleep(8)  # the group rebalances: one of the two holds the host's partition
            first.close()  # ... then the first leaves: the second must take the partition over
            for i in range(5, 10):
                send(host, f"a{i}")
                for h in others:
                    send(h, f"x{i}")
            assert p.flush(10) == 0
            want = {f"a{i}" for i in range(10)}
            wait(lambda: first.applied() | second.applied() >= want, 40, "the second batch")
            both = sorted(c.container for c in first.backend.commands + second.backend.commands)
            assert both == sorted(want), both  # each applied once (a redelivery after the rebalance: duplicate)
            assert first.ignored() == 0 and second.ignored() == 0  # no other host's decision was read
        finally:
            second.close()
    finally:
        if not first.stop.is_set():
            first.close()
