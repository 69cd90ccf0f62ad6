"""The Faust roles' readiness through broker outages and restarts, and the guard that ends a stuck start.

``phasewise worker``, ``phasewise horus`` and ``phasewise place`` run as
subprocesses on a broker of this module's own (the tests pause, stop and
restart it). Their ``/readyz`` must say not ready while the broker is gone
and ready again once it is back; restarted with the same ids after a broker
restart they must become ready; and a worker that cannot become ready while
the broker answers must say why and exit with status 1 instead of hanging.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.request
import uuid

import pytest

from phasewise.kit.broker import EmbeddedBroker, free_port
from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import ContainerSample, HostSamples, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import SAMPLES
from phasewise.streams.worker import ReadyGuard

# --------------------------------------------------------------------------- the guard, no broker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_guard_fires_once_after_the_stall_and_not_while_ready_moving_or_the_broker_is_gone():
    clock = Clock()
    g = ReadyGuard(10.0, clock=clock)
    assert g.tick(False, False, (0, 0)) is None  # the clock starts
    clock.t = 9
    assert g.tick(False, False, (0, 0)) is None
    clock.t = 10.5
    assert g.tick(False, False, (0, 0)) == 10.5
    g.fired = "why"
    clock.t = 30
    assert g.tick(False, False, (0, 0)) is None  # once

    g = ReadyGuard(10.0, clock=clock)
    for t, ready, down, progress in [(0, False, False, (8, 100)), (8, False, False, (8, 200)),  # recovery moves
                                     (16, False, False, (8, 300)), (24, True, False, (8, 300)),  # ready
                                     (30, False, False, (8, 300)), (39, False, True, (8, 300)),  # broker gone
                                     (100, False, True, (8, 300)), (101, False, False, (8, 300))]:
        clock.t = t
        assert g.tick(ready, down, progress) is None, t
    clock.t = 111.5  # 10.5 s after the broker came back, nothing moved
    assert g.tick(False, False, (8, 300)) == pytest.approx(10.5)
    assert ReadyGuard(0.0, clock=clock).tick(False, False, None) is None  # 0: never


def test_the_guard_remembers_a_worker_that_was_ready_once_and_only_that_one_starts_afresh():
    from phasewise.streams.worker import start_afresh

    g = ReadyGuard(10.0, clock=Clock())
    g.tick(False, False, None)
    assert not g.ready_once
    g.tick(True, False, None)
    g.tick(False, False, None)  # a rebalance later: it was ready once
    assert g.ready_once
    assert start_afresh(1, ready_once=False, asked_to_stop=False, attempt=2)
    assert not start_afresh(0, ready_once=False, asked_to_stop=False, attempt=1)  # it ended as asked
    assert not start_afresh(1, ready_once=False, asked_to_stop=True, attempt=1)  # a signal stopped it


def test_a_readiness_shorter_than_the_guards_tick_is_remembered_by_the_ready_gauge():
    """An agent that dies within a second of the worker's readiness: the guard never sampled the gauge at 1,
    but the worker was ready, so it is not started afresh as one that never was (its supervisor decides)."""
    from prometheus_client import CollectorRegistry

    from phasewise.streams.metrics import ReadyGauge
    from phasewise.streams.worker import start_afresh

    gauge = ReadyGauge("phasewise_test_ready", "test", registry=CollectorRegistry())
    g = ReadyGuard(10.0, clock=Clock(), ever_ready=lambda: gauge.ever)
    gauge.set(0)
    g.tick(False, False, None)
    assert not g.ready_once
    gauge.set(1)
    gauge.set(0)  # (the agent died before the next tick)
    g.tick(False, False, None)
    assert g.ready_once and not start_afresh(1, ready_once=g.ready_once, asked_to_stop=False, attempt=1)


def test_the_guard_counts_unreadable_progress_as_none():
    clock = Clock()
    g = ReadyGuard(5.0, clock=clock)
    g.tick(False, False, None)
    clock.t = 6
    assert g.tick(False, False, None) == 6


def test_the_start_guard_fires_only_before_the_subscription_and_never_while_the_broker_is_gone():
    from phasewise.streams.worker import StartGuard

    clock = Clock()
    g = StartGuard(20.0, clock=clock)
    assert g.tick(False, False, False) is None  # the clock starts
    clock.t = 15
    assert g.tick(False, True, False) is None  # the broker is gone: not the start's fault, the clock restarts
    clock.t = 30
    assert g.tick(False, False, False) is None
    clock.t = 50.5
    assert g.tick(False, False, False) == pytest.approx(20.5)
    g = StartGuard(20.0, clock=clock)
    g.tick(False, False, True)  # subscribed: what follows is the group's, ReadyGuard's to watch
    clock.t = 500
    assert g.tick(False, False, False) is None and g.done
    g = StartGuard(20.0, clock=clock)
    g.tick(True, False, False)  # ready once
    clock.t = 900
    assert g.tick(False, False, False) is None
    assert StartGuard(0.0, clock=clock).done  # 0: never


def test_consumer_subscribed_reads_the_kafka_consumer_and_is_false_before_it_exists():
    from types import SimpleNamespace as NS

    from phasewise.streams.worker import consumer_subscribed

    def app(consumer):
        return NS(_consumer=NS(_thread=NS(_consumer=consumer)))

    assert not consumer_subscribed(NS(_consumer=None))  # no consumer built yet
    assert not consumer_subscribed(app(None))
    assert not consumer_subscribed(app(NS(subscription=lambda: frozenset())))
    assert consumer_subscribed(app(NS(subscription=lambda: frozenset({"phasewise.samples.v1"}))))


def test_the_watching_threads_never_build_the_faust_consumer_or_the_recovery_they_read(tmp_path):
    """``app.consumer`` and ``app.tables.recovery`` build on first use; built in a guard's or ``/readyz``'s
    thread they bind to that thread's event loop, and Faust's start then failed with a future "attached to a
    different loop" or hung (the CI flakes). The watchers read only what Faust has built."""
    import threading

    from phasewise.streams.app import create_app
    from phasewise.streams.worker import consumer_subscribed, not_ready_reason, recovery_progress

    s = Settings.from_env({"bootstrap": "127.0.0.1:1", "data_dir": str(tmp_path)}, env={})
    app = create_app(s)
    got: list = []
    t = threading.Thread(target=lambda: got.extend([not_ready_reason(app), recovery_progress(app),
                                                   consumer_subscribed(app)]))
    t.start()
    t.join()
    assert got == ["no partitions assigned yet (joining the consumer group)", None, False]
    assert app._consumer is None and app.tables._recovery is None  # still Faust's to build, in its loop


# --------------------------------------------------------------------------- real roles, a broker of our own



@pytest.fixture
def broker(tmp_path):
    b = EmbeddedBroker(log_path=tmp_path / "tansu.log").start()
    try:
        yield b
    finally:
        b.stop()


def readyz(port: int) -> tuple[int, str]:
    """(status, body) of the role's /readyz; (0, why) for no whole answer (a role that starts afresh replaces
    its process, and with it its server, even in the middle of an answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as e:
        try:
            return e.code, e.read().decode().strip()
        except (OSError, http.client.HTTPException) as cut:
            return 0, f"HTTP {e.code}, its body cut off: {cut!r}"
    except (OSError, http.client.HTTPException) as e:
        return 0, str(e)


class Role:
    """One Faust role subprocess with its /readyz."""

    def __init__(self, tmp, role: str, bootstrap: str, ids: dict[str, str], env: dict[str, str] | None = None):
        self.name, self.tmp, self.port = role, tmp, free_port()
        self.env = {"PHASEWISE_BOOTSTRAP": bootstrap, "PHASEWISE_DATA_DIR": str(tmp / f"{role}-data"),
                    "PHASEWISE_METRICS_PORT": str(self.port), "PHASEWISE_WEB_PORT": "0",
                    "PHASEWISE_STATE_WRITE_INTERVAL_S": "0", **ids, **(env or {})}
        self.n = 0
        self.proc: RoleProcess | None = None

    def start(self) -> Role:
        self.n += 1
        self.proc = RoleProcess(self.name, [], env=self.env, log_path=self.tmp / f"{self.name}-{self.n}.log")
        self.proc.start()
        return self

    def wait(self, want, what: str, timeout_s: float = 120.0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout_s
        got = (0, "")
        while time.monotonic() < deadline:
            assert self.proc.alive(), f"{self.name} exited {self.proc.returncode()}:\n{self.proc.log_tail(40)}"
            got = readyz(self.port)
            if want(got):
                return got
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: {what} not seen in {timeout_s:g} s (last /readyz {got}):\n"
                             + self.proc.log_tail(40))

    def ready(self, timeout_s: float = 120.0) -> None:
        self.wait(lambda g: g == (200, "ok"), "ready", timeout_s)


def roles(tmp, bootstrap: str, tag: str) -> list[Role]:
    ids = {"PHASEWISE_WORKER_ID": f"rw-{tag}", "PHASEWISE_HORUS_WORKER_ID": f"rh-{tag}",
           "PHASEWISE_PLACE_WORKER_ID": f"rp-{tag}"}
    return [Role(tmp, r, bootstrap, ids) for r in ("worker", "horus", "place")]


def feed(settings: Settings) -> None:
    """Samples for a few containers: the worker writes their state to its changelog."""
    p = make_producer(settings)
    now = time.time()
    for i in range(24):
        hs = HostSamples(host=f"h{i % 4}", ts=now + i * 0.1, interval_s=1.0,
                         containers=tuple(ContainerSample(container=f"job-{i % 4}-{j}", cpu_cores=0.5, mem_bytes=1e8)
                                          for j in range(3)))
        p.produce(SAMPLES.name, key=hs.host.encode(), value=encode(hs))
    assert p.flush(10) == 0


def stop_all(rs: list[Role]) -> None:
    for r in rs:
        if r.proc is not None:
            r.proc.stop(20)


@pytest.mark.broker
@pytest.mark.slow
def test_worker_horus_and_place_are_not_ready_while_the_broker_is_gone_and_ready_when_it_is_back(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    rs = roles(tmp_path, broker.bootstrap, uuid.uuid4().hex[:6])
    try:
        for r in rs:
            r.start()
        for r in rs:
            r.ready()
        feed(s)
        broker.pause()  # gone, but keeps its data: as a Kafka broker restarting
        try:
            for r in rs:
                code, why = r.wait(lambda g: g[0] == 503, "not ready during the outage", 60)
                assert why.startswith(f"no Kafka broker answers at {broker.bootstrap}"), (r.name, why)
        finally:
            broker.resume()
        for r in rs:
            r.ready()
        # and stopped for good: connection refused
        broker.stop()
        for r in rs:
            code, why = r.wait(lambda g: g[0] == 503, "not ready with the broker stopped", 60)
            assert why.startswith(f"no Kafka broker answers at {broker.bootstrap}"), (r.name, why)
    finally:
        stop_all(rs)


@pytest.mark.broker
@pytest.mark.slow
def test_restarted_with_the_same_ids_after_a_broker_restart_they_become_ready(broker, tmp_path):
    """The reported sequence: roles with changelogs, the broker stopped and started again on its port,
    the roles restarted with the same ids."""
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    rs = roles(tmp_path, broker.bootstrap, uuid.uuid4().hex[:6])
    port = broker.port
    try:
        for r in rs:
            r.start()
        for r in rs:
            r.ready()
        feed(s)
        time.sleep(3)  # a commit or two: the worker's changelog holds the containers' state
        broker.stop()
        for r in rs:
            r.wait(lambda g: g[0] == 503, "not ready with the broker stopped", 60)
            assert r.proc.stop(30) is not None
        # the embedded broker keeps no data across a restart (memory storage): the topics are created again,
        # as `phasewise topics` or any role's start-up does
        b2 = EmbeddedBroker(port, log_path=tmp_path / "tansu-2.log").start()
        try:
            ensure_topics(s)
            for r in rs:
                r.start()
            for r in rs:
                r.ready(timeout_s=150)
            feed(s)
            for r in rs:
                assert r.proc.alive() and readyz(r.port) == (200, "ok"), r.name
        finally:
            stop_all(rs)
            b2.stop()
    finally:
        stop_all(rs)


@pytest.mark.broker
@pytest.mark.slow
def test_a_worker_that_cannot_become_ready_while_the_broker_answers_says_why_and_exits_1(broker, tmp_path):
    """The embedded broker completes a group join after about half the session timeout: with 30 s the
    worker stays without partitions, its broker answering, for ~15 s, far past a 2 s stall limit."""
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tag = uuid.uuid4().hex[:6]
    r = Role(tmp_path, "worker", broker.bootstrap, {"PHASEWISE_WORKER_ID": f"rs-{tag}"},
             env={"PHASEWISE_READY_STALL_S": "2", "PHASEWISE_SESSION_TIMEOUT_MS": "30000",
                  "PHASEWISE_HEARTBEAT_INTERVAL_MS": "3000"}).start()
    try:
        r.proc.proc.wait(90)
    finally:
        r.proc.stop(20)
    assert r.proc.returncode() == 1, r.proc.log_tail(40)
    log = r.proc.log_path.read_text()
    assert ("phasewise worker: not ready after" in log and "without progress while the broker answers: "
            "no partitions assigned yet (joining the consumer group); exiting with status 1" in log), log[-3000:]


#: the first start's call to the consumer thread to subscribe never returns (as Faust's start was seen to
#: hang, about one start in thirty on a busy machine); a start afresh (same command, next attempt) is normal
STUCK_START = """
import asyncio, os, sys
if os.environ.get("_PHASEWISE_START_ATTEMPT", "1") == "1":
    from faust.transport.drivers import aiokafka as driver
    async def never(self, topics):
        await asyncio.Event().wait()
    driver.AIOKafkaConsumerThread.subscribe = never
from phasewise.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.broker
@pytest.mark.slow
def test_a_worker_whose_start_stalls_before_subscribing_starts_afresh_in_place_and_becomes_ready(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    r = Role(tmp_path, "worker", broker.bootstrap, {"PHASEWISE_WORKER_ID": f"rf-{uuid.uuid4().hex[:6]}"},
             env={"PHASEWISE_START_STALL_S": "3"})
    r.n = 1
    r.proc = RoleProcess("worker", [], env=r.env, log_path=tmp_path / "worker-1.log")
    r.proc.cmd = [r.proc.cmd[0], "-c", STUCK_START, "worker"]
    r.proc.start()
    try:
        r.ready(timeout_s=150)
        log = r.proc.log_path.read_text()
        assert ("phasewise worker: its consumer had not subscribed to its topics" in log
                and "before it was ever ready; starting afresh (attempt 2 of 3)" in log), log[-3000:]
        assert "attempt 3 of 3" not in log  # the second start was not stuck
    finally:
        assert r.proc.stop(30) == 0, r.proc.log_tail(40)
