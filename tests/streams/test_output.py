"""The worker's output producer and commit barrier (phasewise.streams.output).

Unit tests drive the ordering with a fake librdkafka producer whose deliveries
the test releases; the broker test kills a real worker mid-stream and checks
that every source message whose offset was committed has its decision on the
decisions topic, and that a restart loses none.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from prometheus_client import CollectorRegistry

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import ContainerSample, Decision, HostSamples, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DECISIONS, SAMPLES
from phasewise.streams.metrics import WorkerMetrics
from phasewise.streams.output import CommitBarrier, DeliveryFailed, OutputSender, attach


class FakeMsg:
    def __init__(self, topic: str, key, value, partition: int | None = None) -> None:
        self._topic, self.key, self.value, self.partition = topic, key, value, partition

    def topic(self) -> str:
        return self._topic


class FakeProducer:
    """librdkafka's contract: produce() queues, delivery callbacks run inside poll()."""

    def __init__(self, queue_max: int = 1000) -> None:
        self.queued: list[tuple[FakeMsg, object]] = []
        self.delivered: list[FakeMsg] = []
        self.releasable = 0  # deliveries poll() may report
        self.fail_topics: set[str] = set()
        self.queue_max = queue_max

    def produce(self, topic, value, key, on_delivery, partition=None, headers=None):
        if len(self.queued) >= self.queue_max:
            raise BufferError("queue full")
        self.queued.append((FakeMsg(topic, key, value, partition), on_delivery))

    def poll(self, timeout: float) -> int:
        n = 0
        while self.queued and self.releasable > 0:
            msg, cb = self.queued.pop(0)
            self.releasable -= 1
            err = "broker says no" if msg.topic() in self.fail_topics else None
            if err is None:
                self.delivered.append(msg)
            cb(err, msg)
            n += 1
        return n

    def flush(self, timeout: float) -> int:
        self.releasable = len(self.queued)
        self.poll(0)
        return len(self.queued)


def run(coro):
    return asyncio.run(coro)


def test_flush_waits_for_every_record_sent_before_it_and_not_for_later_ones():
    p = FakeProducer()
    out = OutputSender(p, poll_interval_s=0.001)

    async def scenario():
        for i in range(3):
            out.send("decisions", b"h", b"d%d" % i)
        flush = asyncio.ensure_future(out.flush())
        await asyncio.sleep(0.01)
        assert not flush.done()  # nothing delivered yet
        out.send("decisions", b"h", b"later")  # sent while the flush waits: the next commit's
        p.releasable = 2
        await asyncio.sleep(0.01)
        assert not flush.done()  # one record of the flushed three is still out
        p.releasable = 1
        await asyncio.wait_for(flush, 1.0)
        assert [m.value for m in p.delivered] == [b"d0", b"d1", b"d2"]
        assert out.in_flight == 1

    run(scenario())


def test_a_failed_delivery_is_counted_and_every_later_flush_refuses():
    p = FakeProducer()
    metrics = WorkerMetrics(CollectorRegistry())
    out = OutputSender(p, metrics, poll_interval_s=0.001)
    p.fail_topics = {"phases"}
    out.send("decisions", b"h", b"ok")
    out.send("phases", b"c", b"lost")
    p.releasable = 2
    with pytest.raises(DeliveryFailed, match="phases: broker says no"):
        run(out.flush())
    p.fail_topics = set()
    out.send("decisions", b"h", b"fine")
    p.releasable = 1
    with pytest.raises(DeliveryFailed):  # sticky: no offset may be committed past the lost record
        run(out.flush())
    assert metrics.registry.get_sample_value("phasewise_worker_delivery_errors_total", {"topic": "phases"}) == 1


def test_after_an_agent_died_no_commit_passes_the_barrier_and_ready_stays_0():
    from phasewise.streams.agents.scaffold import fail_worker_on_agent_error
    from phasewise.streams.output import WorkerFailed

    p = FakeProducer()
    metrics = WorkerMetrics(CollectorRegistry())
    barrier = CommitBarrier(OutputSender(p, metrics, poll_interval_s=0.001), metrics)
    run(barrier.before_commit())  # nothing held: passes
    metrics.ready.set(1)

    class Agent:
        name = "phasewise.vpa-samples"

    exits: list = []  # the real one would end this process (pytest's) after the grace
    run(fail_worker_on_agent_error(barrier, metrics, exit_later=lambda s, why: exits.append((s, why)))(
        Agent(), RuntimeError("boom")))
    assert exits == [(15.0, "agent phasewise.vpa-samples died: RuntimeError: boom")]
    assert metrics.registry.get_sample_value("phasewise_worker_ready") == 0
    for _ in range(2):  # sticky
        with pytest.raises(WorkerFailed, match="agent phasewise.vpa-samples died: RuntimeError: boom"):
            run(barrier.before_commit())
    assert barrier.commits == 1


def test_a_full_queue_serves_deliveries_until_the_record_fits():
    p = FakeProducer(queue_max=2)
    out = OutputSender(p)
    out.send("t", None, b"1")
    out.send("t", None, b"2")
    p.releasable = 1
    out.send("t", None, b"3")  # the queue had no room: send() polled one delivery out
    assert [m.value for m, _ in p.queued] == [b"2", b"3"] and out.sent == 3


class FakeTable:
    """What the barrier uses of a Faust table: its store, its key serialiser and its changelog topic's name."""

    key_serializer = "json"

    class changelog_topic:  # noqa: N801 - Faust's attribute
        @staticmethod
        def get_topic_name() -> str:
            return CHANGELOG

    def __init__(self) -> None:
        self.data: dict = {}

    def get(self, key):
        return self.data.get(key)


CHANGELOG = "w-tbl-changelog"


def changelog(msgs) -> list[tuple[int, bytes, bytes | None]]:
    """``(partition, key, value)`` of the changelog records among *msgs* (FakeMsg, or (FakeMsg, callback))."""
    ms = [m[0] if isinstance(m, tuple) else m for m in msgs]
    return [(m.partition, m.key, m.value) for m in ms if m.topic() == CHANGELOG]


def test_the_barrier_writes_held_state_only_after_the_outputs_are_delivered():
    p = FakeProducer()
    out = OutputSender(p, poll_interval_s=0.001)
    barrier = CommitBarrier(out)
    table = FakeTable()
    writes = barrier.table(table)

    async def scenario():
        writes.put("h/a", b"s1", 3)
        writes.put("h/a", b"s2", 3)  # latest per key
        writes.put("h/b", b"t1", 3)
        out.send("decisions", b"h", b"decision-a")
        assert writes.get("h/a") == b"s2" and table.get("h/a") is None  # the loader sees its own write
        commit = asyncio.ensure_future(barrier.before_commit())
        await asyncio.sleep(0.01)
        writes.put("h/a", b"s3", 3)  # a later message's state: the next commit's
        assert changelog(p.queued) == [] and not commit.done()  # no state before its decision is delivered
        p.releasable = 1
        await asyncio.sleep(0.01)
        # the state records, keys as the table's JSON key serialiser writes them, in the held partitions;
        # the commit waits for their delivery too
        assert changelog(p.queued) == [(3, b'"h/a"', b"s2"), (3, b'"h/b"', b"t1")] and not commit.done()
        assert table.data == {"h/a": b"s2", "h/b": b"t1"}
        p.releasable = 2
        await asyncio.sleep(0.01)
        # once they are delivered, each partition's last record again, alone: the partition ends with a batch
        # of one (the embedded broker's high watermark is then exact for Faust's recovery)
        assert changelog(p.queued) == [(3, b'"h/b"', b"t1")] and not commit.done()
        p.releasable = 1
        await asyncio.wait_for(commit, 1.0)
        assert writes.get("h/a") == b"s3" and len(writes) == 1

    run(scenario())


def test_what_the_barriers_before_callbacks_send_is_delivered_within_the_same_commit():
    p = FakeProducer()
    out = OutputSender(p, poll_interval_s=0.001)
    barrier = CommitBarrier(out)
    barrier.before.append(lambda: out.send("learn", b"m", b"held-windows"))

    async def scenario():
        commit = asyncio.ensure_future(barrier.before_commit())
        await asyncio.sleep(0.01)
        assert [m.value for m, _ in p.queued] == [b"held-windows"] and not commit.done()  # sent, awaited
        p.releasable = 1
        await asyncio.wait_for(commit, 1.0)

    run(scenario())


def test_marked_states_are_collected_once_per_commit_with_their_hosts_partition():
    p = FakeProducer()
    out = OutputSender(p, poll_interval_s=0.001)
    barrier = CommitBarrier(out)
    marked: dict = {}
    pops: list = []

    def pop_dirty():
        pops.append(dict(marked))
        got = list(marked.items())
        marked.clear()
        return got

    barrier.table(FakeTable(), pop_dirty)
    barrier.partitions.note("h1", 5)
    barrier.partitions.note("odd/host", 2, [ContainerSample(container="x/y", cpu_cores=0.1, mem_bytes=1.0)])
    marked["h1/a"] = {"n": 1}
    marked["h1/a"] = {"n": 2}  # marked again before the commit: one write, latest state
    marked["odd/host/x/y"] = {"n": 3}
    p.releasable = 10
    run(barrier.before_commit())
    written = [(5, b'"h1/a"', b'{"n":2}'), (2, b'"odd/host/x/y"', b'{"n":3}')]
    assert changelog(p.delivered) == written + written  # (each partition's last, sealed)
    assert pops == [{"h1/a": {"n": 2}, "odd/host/x/y": {"n": 3}}]
    run(barrier.before_commit())
    assert len(p.delivered) == 4  # nothing marked since: nothing written, nothing sealed


def test_a_deletion_is_a_tombstone_and_leaves_the_store():
    p = FakeProducer()
    barrier = CommitBarrier(OutputSender(p, poll_interval_s=0.001))
    table = FakeTable()
    writes = barrier.table(table)
    writes.put("job/a", b"x", 1)
    p.releasable = 10
    run(barrier.before_commit())
    writes.put("job/a", None, 1)
    run(barrier.before_commit())
    assert changelog(p.delivered) == [(1, b'"job/a"', b"x")] * 2 + [(1, b'"job/a"', None)] * 2
    assert table.data == {}


def test_attach_runs_the_barrier_before_fausts_own_flush():
    order: list = []

    class Producer:
        async def flush(self):
            order.append("faust flush")

    class App:
        producer = Producer()

    class Barrier:
        metrics = None

        async def before_commit(self):
            order.append("barrier")

    app = App()
    attach(app, Barrier())
    run(app.producer.flush())
    assert order == ["barrier", "faust flush"]


def test_a_changelog_record_not_delivered_refuses_this_and_every_later_commit():
    """The state records go through the output producer: the commit waits for their delivery, and one
    that fails refuses this commit and every later one (no offset past state that was not written)."""
    p = FakeProducer()
    barrier = CommitBarrier(OutputSender(p, poll_interval_s=0.001))
    writes = barrier.table(FakeTable())

    async def scenario():
        writes.put("h/a", b"1", 0)
        commit = asyncio.ensure_future(barrier.before_commit())
        await asyncio.sleep(0.05)
        assert changelog(p.queued) == [(0, b'"h/a"', b"1")] and not commit.done()  # not delivered yet
        p.releasable = 1
        await asyncio.sleep(0.05)
        assert not commit.done()  # its seal is not delivered yet
        p.releasable = 1
        await asyncio.wait_for(commit, 1)
        p.fail_topics = {CHANGELOG}
        writes.put("h/a", b"2", 0)
        p.releasable = 1
        with pytest.raises(DeliveryFailed, match="broker says no"):
            await asyncio.wait_for(barrier.before_commit(), 1)
        p.fail_topics = set()
        with pytest.raises(DeliveryFailed):
            await barrier.before_commit()

    run(scenario())


# ---------------------------------------------------------------------------------------- a real worker
def _committed(settings: Settings, group: str) -> dict[int, int]:
    c = make_consumer(settings, group)
    try:
        tps = c.committed([TopicPartition(SAMPLES.name, p) for p in range(SAMPLES.partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}
    finally:
        c.close()


def _decided(settings: Settings, host: str) -> set[str]:
    """Containers of *host* with a decision on the topic: read past every partition's end, then 2 s idle."""
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    tps = [TopicPartition(DECISIONS.name, p, OFFSET_BEGINNING) for p in range(DECISIONS.partitions)]
    c.assign(tps)
    ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
    seen: dict[int, int] = {}
    got: set[str] = set()
    idle = 0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and (idle < 10 or any(seen.get(p, -1) + 1 < e for p, e in ends.items())):
            m = c.poll(0.2)
            if m is None or m.error():
                idle += 1
                continue
            idle = 0
            seen[m.partition()] = m.offset()
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                continue
            if d.host == host:
                got.add(d.container)
    finally:
        c.close()
    return got


def _start_worker(settings: Settings, tmp, worker_id: str) -> tuple[RoleProcess, int]:
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
           "PHASEWISE_VPA_UPDATE_MODE": "hysteresis", "PHASEWISE_LOG_LEVEL": "info",
           "PHASEWISE_SAFETY_RULES": "false"}  # every container decided at once: delivery is under test
    args = ["--recommend-interval", "0", "--web-port", "0", "--worker-id", worker_id,
            "--data-dir", str(tmp / "data"), "--metrics-port", str(port)]
    role = RoleProcess("worker", args, env=env, log_path=tmp / f"worker-{uuid.uuid4().hex[:4]}.log").start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert role.alive(), "worker exited:\n" + role.log_tail()
        try:
            if scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0:
                return role, port
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("worker not ready:\n" + role.log_tail())


@pytest.mark.broker
@pytest.mark.slow
def test_a_killed_worker_committed_no_offset_whose_decisions_were_not_delivered_and_a_restart_loses_none(
        settings, tmp_path):
    """Every message carries a new unlimited container: its first sample always yields a decision."""
    worker_id = f"pwtest-kill-{uuid.uuid4().hex[:6]}"
    host = f"kill-{uuid.uuid4().hex[:6]}"
    role, _ = _start_worker(settings, tmp_path, worker_id)
    p = make_producer(settings, **{"linger.ms": 0})
    where: dict[str, tuple[int, int]] = {}  # container -> (partition, offset) of its message

    def on_delivery(err, msg):
        assert err is None, err
        where[decode(HostSamples, msg.value()).containers[0].container] = (msg.partition(), msg.offset())

    t0 = time.time() - 600
    killed_at: dict[int, int] = {}
    try:
        i = 0
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for _ in range(20):
                c = f"c{i:05d}"
                hs = HostSamples(host=host, ts=t0 + i, interval_s=1.0, containers=(
                    ContainerSample(container=c, cpu_cores=0.5, mem_bytes=3e8),))
                p.produce(SAMPLES.name, key=host.encode(), value=encode(hs), on_delivery=on_delivery)
                i += 1
            p.flush(10)
            committed = _committed(settings, worker_id)
            mine = {part for part, _ in where.values()}
            if any(committed.get(part, 0) > min(o for q, o in where.values() if q == part) for part in mine):
                os.killpg(role.pid, signal.SIGKILL)  # mid-stream: messages after the commit are in flight
                role.proc.wait()
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the worker committed no offset of ours within 90 s:\n" + role.log_tail())
        killed_at = _committed(settings, worker_id)
        covered = {c for c, (part, off) in where.items() if off < killed_at.get(part, 0)}
        assert covered, "the kill came before any commit"
        decided = _decided(settings, host)
        assert covered <= decided, f"committed without their decisions: {sorted(covered - decided)[:10]}"
    finally:
        if role.alive():
            role.stop()
        role._log.close()

    again, port = _start_worker(settings, tmp_path, worker_id)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(_decided(settings, host)) < len(where):
            time.sleep(1.0)
        missing = set(where) - _decided(settings, host)
        assert not missing, f"{len(missing)} containers never got their decision, e.g. {sorted(missing)[:5]}"
    finally:
        again.stop()


@pytest.mark.broker
def test_a_commits_changelog_ends_each_partition_with_one_record_so_the_embedded_brokers_watermark_is_exact(
        broker, tmp_path):
    """The embedded broker reports a partition's high watermark as the first offset of its last batch + 1,
    and Faust's recovery reads a changelog up to that watermark. A commit's state records go batched (250
    here, one partition), then the last one again alone: the watermark covers every record written."""
    from confluent_kafka.admin import NewTopic

    from phasewise.kit.kafka.client import make_admin
    from phasewise.streams.output import changelog_producer

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    topic = f"pwtest-{uuid.uuid4().hex[:6]}-state-changelog"
    admin = make_admin(s)
    for fut in admin.create_topics([NewTopic(topic, num_partitions=1)]).values():
        fut.result(30)

    class Table(FakeTable):
        class changelog_topic:  # noqa: N801 - Faust's attribute
            @staticmethod
            def get_topic_name() -> str:
                return topic

    sender = OutputSender(changelog_producer(s), poll_interval_s=0.001)
    barrier = CommitBarrier(OutputSender(make_producer(s)), changelog=sender)
    writes = barrier.table(Table())
    for i in range(250):
        writes.put(f"h/c{i}", b'{"n":%d}' % i, 0)
    run(barrier.before_commit())
    c = make_consumer(s, f"pwtest-{uuid.uuid4().hex[:6]}")
    try:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        keys: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(keys) < 251 and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                keys.append(m.key())
    finally:
        c.close()
    assert len(keys) == 251 and keys[-1] == keys[-2] == b'"h/c249"'  # 250 states, the last sealed
    assert hi == 251  # a recovery that reads up to the watermark reads them all
