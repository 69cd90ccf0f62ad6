"""The intake limits in a real ``phasewise worker`` on the module's broker: event time and capacity.

One worker with small capacity limits serves the module; samples go in with
confluent-kafka; decisions, dead letters and the metrics are read back.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import ContainerSample, DeadLetter, Decision, HostSamples, SchemaError, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, SAMPLES

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PER_HOST, PER_MESSAGE = 20, 100


@pytest.fixture(scope="module")
def env(broker, tmp_path_factory):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tmp = tmp_path_factory.mktemp("intake")
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
           "PHASEWISE_VPA_UPDATE_MODE": "hysteresis", "PHASEWISE_SAFETY_RULES": "false",
           "PHASEWISE_RECOMMEND_INTERVAL_S": "1", "PHASEWISE_WEB_PORT": "0", "PHASEWISE_METRICS_PORT": str(port),
           "PHASEWISE_DATA_DIR": str(tmp), "PHASEWISE_WORKER_ID": f"intake-{uuid.uuid4().hex[:6]}",
           "PHASEWISE_INTAKE_MAX_CONTAINERS_PER_HOST": str(PER_HOST),
           "PHASEWISE_INTAKE_MAX_CONTAINERS_PER_MESSAGE": str(PER_MESSAGE)}
    worker = RoleProcess("worker", [], env=env, log_path=tmp / "worker.log").start()
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 150
    while True:
        assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
        try:
            if scrape(url).get("phasewise_worker_ready") == 1.0:
                break
        except OSError:
            pass
        time.sleep(0.2)
    reader = make_consumer(s, f"intake-reader-{uuid.uuid4().hex[:6]}")
    reader.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in (DECISIONS, DEAD_LETTERS)
                   for p in range(t.partitions)])
    yield s, worker, url, reader
    reader.close()
    worker.stop()


_SEEN: dict[int, list] = {}


def read_until(reader, pred, timeout_s: float = 30.0) -> list:
    """Messages of the decisions and dead-letter topics, until *pred(all seen)* holds."""
    seen = _SEEN.setdefault(id(reader), [])
    deadline = time.monotonic() + timeout_s
    while not pred(seen):
        assert time.monotonic() < deadline, "timed out"
        m = reader.poll(0.2)
        if m is not None and not m.error():
            try:
                seen.append(decode(Decision if m.topic() == DECISIONS.name else DeadLetter, m.value()))
            except SchemaError:
                pass  # other tests' hostile records
    return seen


def sample(host: str, ts: float, names, cpu: float = 0.2) -> bytes:
    return encode(HostSamples(host=host, ts=ts, interval_s=0.5, containers=tuple(
        ContainerSample(container=n, cpu_cores=cpu, mem_bytes=3e8, cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                        nr_periods=5) for n in names)))


def test_a_future_stamped_sample_is_dead_lettered_and_the_container_keeps_being_decided(env):
    s, worker, url, reader = env
    host = f"ft-{uuid.uuid4().hex[:6]}"
    p = make_producer(s)
    t0 = time.time() - 60
    for i in range(10):
        p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0 + 0.5 * i, ["job"]))
    p.produce(SAMPLES.name, key=host.encode(), value=sample(host, time.time() + 116 * 86400, ["job"]))
    p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0 - 7200, ["job"]))  # far behind
    for i in range(10, 30):  # demand jumps after the hostile samples: a real decision must follow
        p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0 + 0.5 * i, ["job"], cpu=3.0))
    p.flush(10)

    def done(seen):
        ours = [r for r in seen if isinstance(r, Decision) and r.host == host]
        letters = [r for r in seen if isinstance(r, DeadLetter) and r.key == host]
        return len(letters) >= 2 and any(r.cpu_limit_cores and r.cpu_limit_cores > 3.0 and r.ts > t0 + 5
                                         for r in ours)
    seen = read_until(reader, done)
    letters = [r for r in seen if isinstance(r, DeadLetter) and r.key == host]
    reasons = [r.reason for r in sorted(letters, key=lambda r: r.offset)]
    assert len(letters) == 2, reasons
    assert "ahead of the worker clock" in reasons[0] and "behind the host's newest sample" in reasons[1]
    assert scrape(url).get('phasewise_worker_dead_letters_total{kind="event_time"}') >= 2


def test_a_flood_of_new_containers_is_capped_counted_and_dead_lettered(env):
    s, worker, url, reader = env
    host = f"fl-{uuid.uuid4().hex[:6]}"
    p = make_producer(s)
    t0 = time.time() - 60
    before = scrape(url)
    p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0, [f"c{i}" for i in range(PER_MESSAGE + 1)]))
    p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0 + 0.5, [f"c{i}" for i in range(PER_HOST + 5)]))
    for i in range(2, 12):  # the admitted containers go on being decided; the refused ones again refused
        p.produce(SAMPLES.name, key=host.encode(),
                  value=sample(host, t0 + 0.5 * i, [f"c{i}" for i in range(PER_HOST + 5)]))
    p.flush(10)

    def done(seen):
        return len([r for r in seen if isinstance(r, DeadLetter) and r.key == host]) >= 12
    seen = read_until(reader, done)
    letters = sorted((r for r in seen if isinstance(r, DeadLetter) and r.key == host), key=lambda r: r.offset)
    assert "message holds 101 containers" in letters[0].reason
    assert letters[1].reason.startswith("5 of 25 containers refused (c20, c21, c22, c23, c24)")
    assert "intake_max_containers_per_host" in letters[1].reason
    deadline = time.monotonic() + 60
    while True:
        after = scrape(url)
        refused = {k: after.get(f'phasewise_worker_containers_refused_total{{limit="{k}"}}', 0)
                   - before.get(f'phasewise_worker_containers_refused_total{{limit="{k}"}}', 0)
                   for k in ("message", "host")}
        if refused == {"message": PER_MESSAGE + 1, "host": 5 * 11} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert refused == {"message": PER_MESSAGE + 1, "host": 5 * 11}
    def decided_any(seen):
        return any(isinstance(r, Decision) and r.host == host for r in seen)
    decided = {r.container for r in read_until(reader, decided_any) if isinstance(r, Decision) and r.host == host}
    assert decided and decided <= {f"c{i}" for i in range(PER_HOST)}


FULL = 30  # intake_max_containers_per_worker of the second worker
REAL = f"real-{uuid.uuid4().hex[:6]}"
FAKES = [f"fake-{uuid.uuid4().hex[:8]}" for _ in range(2 * FULL)]  # together twice the worker's limit


@pytest.fixture(scope="module")
def full(broker, tmp_path_factory):
    """A worker whose per-worker limit is small: a flood of invented hosts fills it (it reads only this
    test's hosts: the module's samples topic holds the other tests' too)."""
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tmp = tmp_path_factory.mktemp("intake-full")
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
           "PHASEWISE_VPA_UPDATE_MODE": "hysteresis", "PHASEWISE_SAFETY_RULES": "false",
           "PHASEWISE_RECOMMEND_INTERVAL_S": "1", "PHASEWISE_METRICS_PORT": str(port),
           "PHASEWISE_DATA_DIR": str(tmp), "PHASEWISE_WORKER_ID": f"intake-full-{uuid.uuid4().hex[:6]}",
           "PHASEWISE_INTAKE_MAX_CONTAINERS_PER_WORKER": str(FULL), "PHASEWISE_WORKER_HOSTS": ",".join([REAL, *FAKES])}
    worker = RoleProcess("worker", [], env=env, log_path=tmp / "worker.log").start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 150
    while True:
        assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
        try:
            if scrape(url + "/metrics").get("phasewise_worker_ready") == 1.0:
                break
        except OSError:
            pass
        time.sleep(0.2)
    reader = make_consumer(s, f"intake-full-reader-{uuid.uuid4().hex[:6]}")
    reader.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in (DECISIONS, DEAD_LETTERS)
                   for p in range(t.partitions)])
    yield s, worker, url, reader
    reader.close()
    worker.stop()


def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (v := scrape(url + "/metrics").get(name, 0.0)) < at_least:
        assert time.monotonic() < deadline, f"{name} = {v}, waited for {at_least}"
        time.sleep(0.2)
    return v


def test_invented_hosts_filling_the_worker_leave_real_containers_alone_and_let_a_real_new_one_in(full):
    """The flood of issue #21: names under invented hosts filled the per-worker limit and refused real new
    containers for container_ttl_s (8 days). Now: the real host's containers keep their state, and its
    new container evicts one of the names sent once and is decided."""
    from phasewise.streams.explain import fetch

    s, worker, url, reader = full
    host = REAL
    names = [f"r{i}" for i in range(5)]
    p = make_producer(s)
    t0 = time.time() - 120
    msgs = "phasewise_worker_messages_total"
    base = scrape(url + "/metrics").get(msgs, 0.0)
    for i in range(12):  # in two rounds: the host and its containers are seen in two batches (established)
        p.produce(SAMPLES.name, key=host.encode(), value=sample(host, t0 + 0.5 * i, names))
        if i in (5, 11):
            p.flush(10)
            base = wait_metric(url, msgs, base + 6)
    fakes = FAKES
    for f in fakes:  # sent once each: together twice the worker's limit
        p.produce(SAMPLES.name, key=f.encode(), value=sample(f, t0 + 6.0, ["x"]))
    p.flush(10)
    base = wait_metric(url, msgs, base + len(fakes))
    assert scrape(url + "/metrics")["phasewise_worker_containers"] == FULL
    for i in range(12, 30):  # the real host goes on, with a new container whose demand is high
        p.produce(SAMPLES.name, key=host.encode(),
                  value=encode(HostSamples(host=host, ts=t0 + 0.5 * i, interval_s=0.5, containers=tuple(
                      ContainerSample(container=n, cpu_cores=3.0 if n == "new" else 0.2, mem_bytes=3e8,
                                      cpu_limit_cores=4.0, mem_limit_bytes=8e9, nr_periods=5)
                      for n in [*names, "new"]))))
    p.flush(10)
    wait_metric(url, msgs, base + 18)  # all processed
    read_until(reader, lambda seen: any(isinstance(r, Decision) and r.host == host and r.container == "new"
                                        for r in seen), timeout_s=60)
    status, listed = fetch(url, None)
    assert status == 200
    held = set(listed["containers"])
    assert {f"{host}/{n}" for n in [*names, "new"]} <= held and len(held) <= FULL
    for n in names:  # their state was never dropped: every sample the host sent is in their histograms
        status, card = fetch(url, f"{host}/{n}")
        assert status == 200 and card["vpa"]["numbers"]["cpu_samples"] >= 29, card["vpa"]["numbers"]
    m = scrape(url + "/metrics")
    assert m['phasewise_worker_containers_evicted_total{limit="worker"}'] >= 1
    assert m["phasewise_worker_containers"] <= FULL
    letters = [r for r in read_until(reader, lambda seen: True) if isinstance(r, DeadLetter) and r.key == host]
    assert not letters  # nothing of the real host was refused
