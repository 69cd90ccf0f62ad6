"""The host agent: bounded buffer, in-order retry, real broker publishing, outage then recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer
from phasewise.kit.records import HostSamples, decode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import SAMPLES
from phasewise.producers.host_agent import Agent, Outgoing, Publisher, SampleBuffer
from phasewise.producers.metrics import ProducerMetrics
from phasewise.producers.sampler import HostSampler

# --------------------------------------------------------------------------- buffer and publisher


def out(seq: int) -> Outgoing:
    return Outgoing(seq, b"h", f"m{seq}".encode())


def test_the_bounded_buffer_drops_the_oldest_when_full_and_counts_it():
    b = SampleBuffer(3)
    dropped = [b.push(out(i)) for i in range(1, 6)]
    assert dropped == [0, 0, 0, 1, 1]
    assert b.dropped == 2 and len(b) == 3
    assert [m.seq for m in b.take(10)] == [3, 4, 5]


def test_requeued_messages_go_back_to_the_front_in_order_and_respect_the_bound():
    b = SampleBuffer(4)
    for i in (5, 6):
        b.push(out(i))
    assert b.requeue([out(3), out(1), out(2)]) == 1  # 5 messages > 4: the oldest (1) goes
    assert [m.seq for m in b.take(10)] == [2, 3, 5, 6]


def test_a_buffer_needs_room_for_at_least_one_message():
    with pytest.raises(ValueError, match="buffer_max_messages"):
        SampleBuffer(0)


class RecordingProducer:
    """Stands in for confluent_kafka.Producer: records produce calls; the test delivers."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def produce(self, topic, key=None, value=None, on_delivery=None):
        self.sent.append((value, on_delivery))

    def poll(self, timeout=0):
        return 0

    def deliver(self, err=None):
        sent, self.sent = self.sent, []
        for _value, cb in sent:
            cb(err, None)
        return [v for v, _ in sent]


def test_publisher_probes_with_one_batch_and_retries_failures_first_in_order():
    p = RecordingProducer()
    metrics = ProducerMetrics(CollectorRegistry())
    pub = Publisher(p, SAMPLES, SampleBuffer(100), metrics=metrics)
    pub.submit(b"h", b"1")
    pub.submit(b"h", b"2")  # waits: nothing has been delivered yet
    assert [v for v, _ in p.sent] == [b"1"]
    assert p.deliver(err="broker down") == [b"1"]
    pub.pump()
    assert [v for v, _ in p.sent] == [b"1", b"2"]  # the failed one first, then the waiting one
    pub.submit(b"h", b"3")  # still unproven: waits in the buffer
    assert p.deliver(err=None) == [b"1", b"2"]
    pub.pump()
    assert p.deliver() == [b"3"]
    pub.submit(b"h", b"4")  # healthy now: dispatched at once
    assert [v for v, _ in p.sent] == [b"4"]
    assert metrics.registry.get_sample_value("phasewise_producer_delivered_total") == 3
    assert metrics.registry.get_sample_value("phasewise_producer_buffered") == 1


def test_publisher_counts_drops_when_an_outage_outlasts_the_buffer():
    p = RecordingProducer()
    metrics = ProducerMetrics(CollectorRegistry())
    pub = Publisher(p, SAMPLES, SampleBuffer(3), metrics=metrics)
    for i in range(1, 7):
        pub.submit(b"h", str(i).encode())
    # 1 in flight, buffer holds 4, 5, 6 (2 and 3 dropped)
    assert metrics.registry.get_sample_value("phasewise_producer_dropped_total") == 2
    p.deliver(err="timed out")  # 1 comes back to the front, but it is the oldest of 4: dropped
    pub.pump()
    assert p.deliver() == [b"4", b"5", b"6"]
    assert metrics.registry.get_sample_value("phasewise_producer_dropped_total") == 3


# --------------------------------------------------------------------------- against a real broker


def consume_host(settings: Settings, host: str, want: int, timeout_s: float = 40.0) -> list[HostSamples]:
    consumer = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([SAMPLES.name])
    got: list[HostSamples] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and len(got) < want:
            m = consumer.poll(0.5)
            if m is None or m.error():
                continue
            if m.key() == host.encode():
                got.append(decode(HostSamples, m.value()))
    finally:
        consumer.close()
    return got


def run_agent(agent: Agent) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    t.start()
    return t, stop


@pytest.mark.broker
def test_the_agent_publishes_one_message_per_tick_keyed_by_host(settings, v2tree):
    v2tree.set("job-a", cpu_s=1.0, mem=2**20)
    v2tree.set("job-b", cpu_s=2.0, mem=2**21)
    s = settings.replace(interval_s=0.2)
    agent = Agent(s, HostSampler(v2tree.layout, host=s.host, gpu=False), metrics=ProducerMetrics(CollectorRegistry()))
    stop = threading.Event()
    agent.run(stop, max_ticks=3)
    assert agent.close(10.0) == 0
    msgs = consume_host(s, s.host, want=3)
    assert len(msgs) == 3
    for m in msgs:
        assert m.host == s.host and m.interval_s == pytest.approx(0.2, abs=0.15)
        assert {c.container for c in m.containers} == {"job-a", "job-b"}
    assert [m.ts for m in msgs] == sorted(m.ts for m in msgs)
    reg = agent.metrics.registry
    assert reg.get_sample_value("phasewise_producer_samples_total") == 3
    assert reg.get_sample_value("phasewise_producer_delivered_total") == 3
    assert reg.get_sample_value("phasewise_producer_sample_seconds_count") == 3


@pytest.mark.broker
@pytest.mark.slow
def test_samples_wait_while_the_broker_is_down_and_arrive_in_order_when_it_returns(v2tree):
    port = free_port()
    s = Settings.from_env({"bootstrap": f"127.0.0.1:{port}", "host": f"test-{uuid.uuid4().hex[:6]}",
                           "interval_s": 0.2}, env={})
    v2tree.set("job-a", cpu_s=1.0)
    agent = Agent(s, HostSampler(v2tree.layout, host=s.host, gpu=False), metrics=ProducerMetrics(CollectorRegistry()))
    thread, stop = run_agent(agent)
    try:
        deadline = time.monotonic() + 60
        while len(agent.publisher.buffer) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(agent.publisher.buffer) >= 5, "ticks must accumulate in the buffer while no broker answers"
        assert agent.publisher.delivered == 0
        assert agent.metrics.registry.get_sample_value("phasewise_producer_buffered") >= 5
        with EmbeddedBroker(port=port):
            ensure_topics(s, [SAMPLES])
            deadline = time.monotonic() + 40
            while agent.publisher.delivered < 8 and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            thread.join(10)
            assert agent.close(15.0) == 0
            published = agent.ticks
            msgs = consume_host(s, s.host, want=published)
    finally:
        stop.set()
        thread.join(10)
    assert len(msgs) == published >= 8
    ts = [m.ts for m in msgs]
    assert ts == sorted(ts) and len(set(ts)) == len(ts), "buffered messages must arrive once each, in order"
    assert agent.metrics.registry.get_sample_value("phasewise_producer_dropped_total") == 0


# --------------------------------------------------------------------------- the CLI role


def test_produce_once_prints_one_host_samples_json_without_kafka(v2tree):
    v2tree.set("job-a", cpu_s=1.0, mem=4096)
    env = {**os.environ, "PHASEWISE_BOOTSTRAP": "127.0.0.1:1"}  # unreachable: --once must not need it
    r = subprocess.run(
        [sys.executable, "-m", "phasewise.cli", "produce", "--once", "--interval", "0.1", "--host", "h-once",
         "--cgroup-root", str(v2tree.root), "--cgroup-prefix", v2tree.prefix],
        check=False, env=env, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    msg = decode(HostSamples, r.stdout.strip())
    assert msg.host == "h-once" and [c.container for c in msg.containers] == ["job-a"]
    assert "settings: " in r.stderr and json.loads(r.stdout)["v"] == 1


def test_produce_exits_cleanly_on_sigterm_and_says_what_was_undelivered(v2tree, tmp_path):
    v2tree.set("job-a", cpu_s=1.0)
    env = {**os.environ, "PHASEWISE_BOOTSTRAP": f"127.0.0.1:{free_port()}", "PHASEWISE_FLUSH_TIMEOUT_S": "0.5",
           "PHASEWISE_CREATE_TOPICS": "false"}
    p = subprocess.Popen(
        [sys.executable, "-m", "phasewise.cli", "produce", "--interval", "0.1", "--host", "h-term",
         "--cgroup-root", str(v2tree.root), "--cgroup-prefix", v2tree.prefix],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    time.sleep(3.0)
    p.send_signal(signal.SIGTERM)
    output, _ = p.communicate(timeout=30)
    assert p.returncode == 0, output
    assert "settings: " in output
    assert "signal 15: stopping" in output
    assert "undelivered" in output


def test_produce_rejects_a_root_that_is_no_cgroup_mount(tmp_path):
    r = subprocess.run([sys.executable, "-m", "phasewise.cli", "produce", "--once", "--cgroup-root", str(tmp_path)],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "neither a cgroup v2 mount nor a directory of v1 hierarchies" in r.stderr
