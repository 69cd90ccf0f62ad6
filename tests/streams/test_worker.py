"""``phasewise worker`` for real: a Faust worker subprocess on a broker of its own.

One worker serves the module (start-up costs ~5 s). Samples go in with
confluent-kafka; decisions and dead letters are read back from their topics.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    ContainerSample,
    DeadLetter,
    Decision,
    HostSamples,
    SchemaError,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, SAMPLES

pytestmark = [pytest.mark.broker, pytest.mark.slow]


class Worker:
    def __init__(self, settings: Settings, tmp, worker_id: str) -> None:
        self.metrics_port = free_port()
        env = {
            "PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap,
            "PHASEWISE_VPA_TIME_SCALE": "0.001",
            "PHASEWISE_VPA_UPDATE_MODE": "hysteresis",  # these tests check decisions within seconds
            # the VPA's own decisions: tests/streams/test_safety_rules.py runs a worker with the rules on
            "PHASEWISE_SAFETY_RULES": "false",
            "PHASEWISE_LOG_LEVEL": "info",
        }
        args = ["--recommend-interval", "1", "--worker-id", worker_id,
                "--data-dir", str(tmp / "data"), "--metrics-port", str(self.metrics_port)]
        self.role = RoleProcess("worker", args, env=env, log_path=tmp / f"worker-{uuid.uuid4().hex[:4]}.log")

    def start(self, timeout_s: float = 150.0) -> Worker:
        self.role.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.role.alive(), "worker exited:\n" + self.role.log_tail()
            try:
                if scrape(f"http://127.0.0.1:{self.metrics_port}/metrics").get("phasewise_worker_ready") == 1.0:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("worker not ready:\n" + self.role.log_tail())

    def metric(self, name: str) -> float:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics").get(name, 0.0)


class Reader:
    """Reads a topic from the beginning without a consumer group (no join delay)."""

    def __init__(self, settings: Settings, topic: str, partitions: int) -> None:
        self.c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.seen: list = []

    def wait_for(self, pred, timeout_s: float = 60.0, what: str = "a message") -> list:
        """The messages *pred* takes, read so far or within *timeout_s*; each message is tested once per call
        (a topic other tests filled: thousands of messages)."""
        hits = [m for m in self.seen if pred(m)]
        deadline = time.monotonic() + timeout_s
        while True:
            got = [m for m in self.c.consume(500, 0 if hits else 0.2) if not m.error()]
            self.seen += got
            hits += [m for m in got if pred(m)]
            if hits and not got:  # what has arrived is read
                return hits
            if not hits and time.monotonic() >= deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f}s ({len(self.seen)} messages read)")

    def close(self) -> None:
        self.c.close()


@pytest.fixture(scope="module")
def module_settings(broker) -> Settings:
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    return s


@pytest.fixture(scope="module")
def worker_id() -> str:
    return f"pwtest-worker-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def worker(module_settings, tmp_path_factory, worker_id):
    w = Worker(module_settings, tmp_path_factory.mktemp("worker"), worker_id).start()
    yield w
    w.role.stop()


@pytest.fixture(scope="module")
def decisions(module_settings):
    r = Reader(module_settings, DECISIONS.name, DECISIONS.partitions)
    yield r
    r.close()


@pytest.fixture(scope="module")
def dead_letters(module_settings):
    r = Reader(module_settings, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
    yield r
    r.close()


def samples(host: str, container: str, ts: float, cpu: float, *, cpu_limit: float = 4.0,
            mem: float = 3e8, mem_limit: float = 8e9) -> bytes:
    return encode(HostSamples(host=host, ts=ts, interval_s=0.5, containers=(
        ContainerSample(container=container, cpu_cores=cpu, mem_bytes=mem, cpu_limit_cores=cpu_limit,
                        mem_limit_bytes=mem_limit, nr_periods=5),
    )))


def decision_for(host: str, container: str):
    def pred(m) -> bool:
        try:  # other tests share the topic and put malformed decisions on it on purpose
            d = decode(Decision, m.value())
        except SchemaError:
            return False
        return d.host == host and d.container == container
    return pred


def _dead_letter_key(m) -> str | None:
    try:
        return decode(DeadLetter, m.value()).key
    except SchemaError:
        return None


T0 = time.time() - 120


def test_an_idle_container_gets_a_lowering_vpa_decision(module_settings, worker, decisions):
    host = f"h-{uuid.uuid4().hex[:6]}"
    p = make_producer(module_settings)
    for i in range(20):  # 10 s of event time, 0.2 cores used under a 4-core limit
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, "idle", T0 + 0.5 * i, 0.2))
    p.flush(10)
    d = decode(Decision, decisions.wait_for(decision_for(host, "idle"), what="decision")[0].value())
    assert d.policy == "vpa" and d.action == "limit"
    assert d.cpu_limit_cores is not None and 0.2 < d.cpu_limit_cores < 0.5  # p90 bucket end * 1.15
    assert d.mem_limit_bytes is not None and 3e8 < d.mem_limit_bytes < 4e8
    assert d.details["cpu_samples"] >= 3 and d.details["previous"]["cpu"] == 4.0
    assert d.details["cpu_percentiles"]["p90"] == pytest.approx(d.details["cpu"]["target"] / 1.15)
    assert "vpa target" in d.reason and d.ts >= T0 + 1.0


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process *pid* listens on (its sockets in LISTEN state, from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.read().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_worker_serves_nothing_but_its_metrics_server_by_default(worker):
    """No Faust web server (it would serve the tables' contents to anyone on the host): the worker's one
    listening socket is its metrics server, which serves /scorecard/ too."""
    assert listening_ports(worker.role.pid) == {worker.metrics_port}


def test_the_scorecard_of_the_real_worker_on_its_metrics_port(module_settings, worker, decisions):
    from urllib.request import urlopen

    from phasewise.streams.explain import fetch

    host = f"h-{uuid.uuid4().hex[:6]}"
    p = make_producer(module_settings)
    for i in range(20):
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, "scored", T0 + 0.5 * i, 0.2))
    p.flush(10)
    decisions.wait_for(decision_for(host, "scored"), what="decision")
    url = f"http://127.0.0.1:{worker.metrics_port}"
    deadline = time.monotonic() + 60
    while abs(((got := fetch(url, f"{host}/scored"))[1].get("now", {}).get("t") or 0) - (T0 + 9.5)) > 1e-3:
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    status, card = got
    assert status == 200 and card["now"]["cpu"]["limit"] == 4.0 and card["now"]["cpu"]["vpa"] is not None
    rows = {(r["window_s"], r["resource"], r["policy"]): r for r in card["scorecard"]}
    assert rows[(300.0, "cpu", "limit")]["steps"] > 0 and rows[(300.0, "cpu", "vpa")]["steps"] > 0
    assert fetch(url, f"{host}/nothing")[0] == 404
    want = 'phasewise_worker_scorecard_fulfilment{policy="limit",resource="cpu",window="300s"}'
    deadline = time.monotonic() + 60
    while True:  # rescored at most once a second
        with urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        if want in text or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert want in text and host not in text


def test_a_workload_asking_for_a_policy_the_worker_does_not_run_is_refused_visibly(
        module_settings, worker, decisions):
    """A --policy vpa worker without --phase-workloads: the container whose workload asks for the phase
    policy gets no decision (not a VPA one in its place), the metric counts it, explain says why; its
    neighbour in the same message is decided as usual."""
    from phasewise.kit.records import WorkloadPolicy
    from phasewise.streams.explain import fetch

    host = f"h-{uuid.uuid4().hex[:6]}"
    wants = WorkloadPolicy(mode="apply", source="annotation", policy="phase")
    p = make_producer(module_settings)
    for i in range(20):
        p.produce(SAMPLES.name, key=host.encode(), value=encode(HostSamples(host=host, ts=T0 + 0.5 * i, interval_s=0.5,
                  containers=tuple(ContainerSample(container=c, cpu_cores=0.2, mem_bytes=3e8, cpu_limit_cores=4.0,
                                                   mem_limit_bytes=8e9, nr_periods=5, workload=w)
                                   for c, w in (("plain", None), ("wants-phase", wants))))))
    p.flush(10)
    decisions.wait_for(decision_for(host, "plain"), what="decision")
    assert not [m for m in decisions.seen if decision_for(host, "wants-phase")(m)]
    deadline = time.monotonic() + 60  # the plain container's decision may come before the last of the 20 messages
    while worker.metric('phasewise_worker_policy_refused_total{policy="phase"}') < 20 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker.metric('phasewise_worker_policy_refused_total{policy="phase"}') >= 20
    status, card = fetch(f"http://127.0.0.1:{worker.metrics_port}", f"{host}/wants-phase")
    assert status == 200 and card["policy"] == "phase" and card["worker_policy"] == "vpa"
    assert "not decided" in card["refused"] and "--phase-workloads" in card["refused"]
    assert f"container {host}/wants-phase refused" in worker.role.log_tail(200)


BAD = [
    (b"this is not json", "not valid JSON"),
    (json.dumps({"v": 2, "host": "x", "ts": 1.0, "interval_s": 1.0}).encode(), "unsupported schema version"),
    (json.dumps({"v": 1, "host": "x", "interval_s": 1.0}).encode(), "missing field 'ts'"),
    (b'{"v":1,"host":"x","ts":1.0,"interval_s":1.0,"containers":[{"container":"c","cpu_cores":-1,"mem_bytes":1}]}',
     "below the minimum"),
    (b'{"v":1,"host":"x","ts":1.0,"interval_s":1.0,"containers":[{"container":"c","cpu_cores":NaN,"mem_bytes":1}]}',
     "must be finite"),
    (b'{"v":1,"host":"x","ts":1.0,"interval_s":1.0,"containers":[{"container":"c","cpu_cores":1,"mem_bytes":1e30}]}',
     "above the maximum"),
]


def test_bad_samples_are_dead_lettered_with_reasons_and_the_worker_carries_on(
        module_settings, worker, decisions, dead_letters):
    host = f"bad-{uuid.uuid4().hex[:6]}"
    p = make_producer(module_settings)
    for value, _ in BAD:
        p.produce(SAMPLES.name, key=host.encode(), value=value)
    for i in range(10):  # then a valid stream from the same host
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, "after", T0 + 0.5 * i, 0.1))
    p.flush(10)
    letters = dead_letters.wait_for(lambda m: _dead_letter_key(m) == host, what="dead letter")
    deadline = time.monotonic() + 60
    while len(letters) < len(BAD) and time.monotonic() < deadline:
        letters = dead_letters.wait_for(lambda m: _dead_letter_key(m) == host)
    got = [decode(DeadLetter, m.value()) for m in letters]
    assert len(got) == len(BAD)
    for dl, (value, why) in zip(sorted(got, key=lambda d: d.offset), BAD):
        assert why in dl.reason, (why, dl.reason)
        assert dl.source_topic == SAMPLES.name and dl.partition is not None and dl.offset is not None
        assert dl.payload == value.decode()
    d = decode(Decision, decisions.wait_for(decision_for(host, "after"), what="decision")[0].value())
    assert d.policy == "vpa" and d.cpu_limit_cores < 4.0
    assert worker.role.alive()
    assert worker.metric('phasewise_worker_dead_letters_total{kind="schema"}') >= len(BAD)


def test_sigterm_stops_the_worker_cleanly_and_a_restart_recovers_container_state(
        module_settings, worker, decisions, tmp_path_factory, worker_id):
    host = f"rec-{uuid.uuid4().hex[:6]}"
    p = make_producer(module_settings)
    for i in range(20):
        p.produce(SAMPLES.name, key=host.encode(), value=samples(host, "job", T0 + 0.5 * i, 0.2))
    p.flush(10)
    first = decode(Decision, decisions.wait_for(decision_for(host, "job"), what="decision")[0].value())
    time.sleep(1.0)  # let the table write that came with the decision reach the changelog
    assert worker.role.stop(timeout_s=30) == 0, worker.role.log_tail()

    again = Worker(module_settings, tmp_path_factory.mktemp("worker2"), worker_id).start()
    try:
        # demand jumps: 6 samples at 2.0 cores on top of the 20 at 0.2 moves p90 up
        for i in range(20, 26):
            p.produce(SAMPLES.name, key=host.encode(), value=samples(host, "job", T0 + 0.5 * i, 2.0))
        p.flush(10)
        hits = decisions.wait_for(
            lambda m: decision_for(host, "job")(m) and decode(Decision, m.value()).id != first.id,
            what="decision after restart")
        d = decode(Decision, hits[0].value())
        assert d.cpu_limit_cores > 2.0
        # history from before the restart came back from the changelog: the decided
        # limit it compares with (the samples report 4 cores) and the span of samples
        assert d.details["previous"]["cpu"] == first.cpu_limit_cores
        assert d.details["history_s"] >= 10.0
    finally:
        again.role.stop()
