"""``phasewise horus`` for real: a Faust worker subprocess on the module's broker.

Job events and samples go in with confluent-kafka; predictions and dead letters
are read back from their topics; the join of a job with its container's
samples is interrupted by a restart.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    ContainerSample,
    DeadLetter,
    HostSamples,
    JobEvent,
    JobSpec,
    PhaseChange,
    SchemaError,
    UtilisationPrediction,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, HORUS_ROUTES, JOB_EVENTS, PHASES, PREDICTIONS, SAMPLES

pytestmark = [pytest.mark.broker, pytest.mark.slow]


class Horus:
    def __init__(self, settings: Settings, tmp, horus_id: str, **extra_env: str) -> None:
        self.metrics_port = free_port()
        env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_LOG_LEVEL": "info",
               "PHASEWISE_HORUS_WARMUP_S": "1000", "PHASEWISE_HORUS_OBSERVE_S": "2",
               "PHASEWISE_HORUS_MIN_SAMPLES": "3",
               # the module's models topic holds what its other tests' horus workers shared
               "PHASEWISE_HORUS_SHARE_MODEL": "false", **extra_env}
        args = ["--horus-id", horus_id, "--data-dir", str(tmp / "data"), "--metrics-port", str(self.metrics_port)]
        self.role = RoleProcess("horus", args, env=env, log_path=tmp / f"horus-{uuid.uuid4().hex[:4]}.log")

    def start(self, timeout_s: float = 150.0) -> Horus:
        self.role.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.role.alive(), "horus exited:\n" + self.role.log_tail()
            if self.metric("phasewise_horus_ready") == 1.0:
                from tests.streams.test_placement_worker import health_answers_of

                health_answers_of(f"http://127.0.0.1:{self.metrics_port}", "horus")
                return self
            time.sleep(0.2)
        raise TimeoutError("horus not ready:\n" + self.role.log_tail())

    def metric(self, name: str) -> float:
        try:
            return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics").get(name, 0.0)
        except OSError:
            return 0.0

    def wait_metric(self, name: str, at_least: float, timeout_s: float = 60.0) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (v := self.metric(name)) >= at_least:
                return v
            time.sleep(0.2)
        raise TimeoutError(f"{name} < {at_least}:\n" + self.role.log_tail(60))


def read_all(settings: Settings, topic: str, partitions: int, pred, n: int, timeout_s: float = 60.0) -> list:
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    hits: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and len(hits) < n:
            m = c.poll(0.2)
            if m is not None and not m.error() and pred(m):
                hits.append(m)
    finally:
        c.close()
    return hits


def _dl_key(m) -> str | None:
    try:
        return decode(DeadLetter, m.value()).key
    except SchemaError:
        return None


def test_predictions_dead_letters_and_a_join_across_a_restart(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tag = uuid.uuid4().hex[:6]
    horus_id = f"pwtest-horus-{tag}"
    h = Horus(s, tmp_path, horus_id).start()
    p = make_producer(s)

    def job(name: str, kind: str, ts: float, **kw) -> bytes:
        return encode(JobEvent(job=name, ts=ts, kind=kind, **kw))

    spec = JobSpec(model="mlp-32x64x4", dataset="vectors", batch_size=16)
    a, b, bad_ds = f"a-{tag}", f"b-{tag}", f"c-{tag}"
    # (under JobEvent.MAX_BYTES, so that their own reasons refuse them, not their size)
    poison = [None, b"[" * 60_000, bytes(range(256)) * 240,
              json.dumps({"v": 1, "job": "x", "ts": "yesterday", "kind": "submitted"}).encode()]
    # the priority agent's hints are not the horus agent's: skipped, however stamped (no dead letter)
    hints = [job(a, "admitted", time.time() + 1e7, host="h", resume=True), job(a, "stopped", 0.0)]
    records = [job(a, "submitted", 1.0, spec=spec), *hints, *poison,
               job(bad_ds, "submitted", 1.0, spec=JobSpec(model="resnet18", dataset="mnist", batch_size=8)),
               job(f"d-{tag}", "submitted", time.time() + 1e7, spec=spec),  # ~116 days ahead: refused
               job(b, "submitted", 1.0, spec=spec, priority=3)]
    hints_at: list[int] = []
    for v in records:  # one partition, so the valid ones sit between the bad ones
        p.produce(JOB_EVENTS.name, key=f"k-{tag}".encode(), value=v, partition=0,
                  on_delivery=(lambda err, m: hints_at.append(m.offset())) if v in hints else None)
    p.flush(20)
    assert len(hints_at) == 2

    preds = read_all(s, PREDICTIONS.name, PREDICTIONS.partitions, lambda m: m.key() in (a.encode(), b.encode()), 2)
    got = {decode(UtilisationPrediction, m.value()).job: decode(UtilisationPrediction, m.value()) for m in preds}
    assert set(got) == {a, b}, h.role.log_tail(60)
    pa = got[a]
    assert pa.first_sight and pa.features["linear"] == 2 and pa.coverage == 0.8
    assert pa.cpu_cores.lo <= pa.cpu_cores.mean <= pa.cpu_cores.hi

    def ours(m) -> bool:
        try:
            return decode(DeadLetter, m.value()).key == f"k-{tag}"
        except SchemaError:
            return False

    dls = [decode(DeadLetter, m.value()) for m in read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, ours, 6)]
    reasons = sorted(d.reason for d in dls)
    assert len(dls) == 6, reasons
    assert not {d.offset for d in dls} & set(hints_at), reasons  # (a hint's letter would be among the first 6)
    assert any("ahead of the worker clock" in r for r in reasons)
    assert any("no value" in r for r in reasons) and any("nested too deeply" in r for r in reasons)
    assert any("not valid JSON" in r for r in reasons) and any("'ts' must be a number" in r for r in reasons)
    assert any("unknown dataset 'mnist'" in r for r in reasons)

    # a's container runs on host H; two steady samples, a restart, then the third completes the observation
    host = f"hz-{tag}"
    t0 = time.time() - 60

    def sample(ts: float, cpu: float) -> bytes:
        return encode(HostSamples(host=host, ts=ts, interval_s=1.0, containers=(
            ContainerSample(container="ca", cpu_cores=cpu, mem_bytes=5e8),
            ContainerSample(container="other", cpu_cores=9.0, mem_bytes=1e9))))

    p.produce(JOB_EVENTS.name, key=a.encode(), value=job(a, "started", t0, host=host, container="ca"), partition=0)
    p.flush(10)
    # the started event routed and joined (a and b booked, a joined) before the phase change and the samples
    h.wait_metric("phasewise_horus_jobs", 3)
    # the detector says the container left its loading phase at t0 + 0.5 (the warm-up is 1000 s);
    # a null and a record of wrong types on the phases topic around it are dead letters
    pkey = f"ca-{tag}".encode()
    for v in (None, json.dumps({"v": 1, "container": 5}).encode(),
              encode(PhaseChange(container="ca", host=host, ts=t0 + 0.5, new_phase=1, since=t0))):
        p.produce(PHASES.name, key=pkey, value=v, partition=0)
    p.flush(10)
    skey = f"s-{tag}"
    p.produce(SAMPLES.name, key=skey.encode(), value=bytes(range(256)) * 2400)  # 600 kB of binary: a sample?
    p.flush(10)
    assert len(read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, lambda m: _dl_key(m) == pkey.decode(),
                        2)) == 2
    assert len(read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, lambda m: _dl_key(m) == skey, 1)) == 1
    time.sleep(1.0)
    for i, cpu in ((1, 1.0), (2, 1.0)):
        p.produce(SAMPLES.name, key=host.encode(), value=sample(t0 + i, cpu))
    p.flush(10)
    deadline = time.monotonic() + 30
    while "restored" not in h.role.log_tail(200) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(4.0)  # a commit interval: the join state is written with the offsets
    assert h.metric("phasewise_horus_jobs_learned_total") == 0
    assert h.role.stop(timeout_s=30) == 0, h.role.log_tail()

    h2 = Horus(s, tmp_path, horus_id).start()
    try:
        p.produce(SAMPLES.name, key=host.encode(), value=sample(t0 + 3, 4.0))
        p.flush(10)
        h2.wait_metric("phasewise_horus_jobs_learned_total", 1)
        log = h2.role.log_tail(200)
        assert f"learned job {a}" in log and "cpu_cores=2 " in log.replace(",", " "), log
        assert h2.metric("phasewise_horus_model_jobs") == 1
        assert h2.metric('phasewise_horus_prediction_log_error_count{target="cpu_cores"}') == 1
    finally:
        h2.role.stop()


def test_with_a_cluster_key_predictions_are_signed_and_only_a_signed_started_event_is_taken(broker, tmp_path):
    from phasewise.kit.signing import Keyring

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(b"k" * 48)
    key_file.chmod(0o600)
    ring = Keyring(b"k" * 48)
    tag = uuid.uuid4().hex[:6]
    h = Horus(s, tmp_path, f"pwtest-horus-signed-{tag}", PHASEWISE_SIGNING_KEY_FILE=str(key_file)).start()
    try:
        p = make_producer(s)
        a = f"signed-{tag}"
        p.produce(JOB_EVENTS.name, key=a.encode(), value=encode(JobEvent(
            job=a, ts=time.time(), kind="submitted", spec=JobSpec(model="mlp-32x64x4", dataset="vectors",
                                                                   batch_size=16))))
        # a job-events writer without the cluster key says where the job runs: not taken
        p.produce(JOB_EVENTS.name, key=a.encode(), value=encode(JobEvent(job=a, ts=time.time(), kind="started",
                                                                          host="h", container="victim")))
        p.flush(10)
        (m,) = read_all(s, PREDICTIONS.name, PREDICTIONS.partitions, lambda m: m.key() == a.encode(), 1)
        assert ring.verify(PREDICTIONS.name, m.key(), m.value(), m.headers()) is None
        (dl,) = read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, lambda m: _dl_key(m) == a, 1)
        assert f"JobEvent started {a} refused: unsigned" in decode(DeadLetter, dl.value()).reason
        assert "are published unsigned" not in h.role.log_tail(400)
    finally:
        h.role.stop()


def _named(prefix: str, partition: int, n: int = 8) -> str:
    """A name whose CRC32 partition of *n* is *partition* (librdkafka's default partitioner)."""
    for i in range(100_000):
        name = f"{prefix}{i}"
        if zlib.crc32(name.encode()) % n == partition:
            return name
    raise AssertionError("no name")


def test_two_workers_of_one_group_learn_every_job_once_wherever_its_events_and_samples_are(broker, tmp_path):
    """Two horus workers share one horus_worker_id: they split the job events by job and the samples by
    host. Eight jobs whose event partitions and host partitions form a cycle (job partition p, host partition
    p + 1) cross between the workers wherever the split falls, so at least two jobs have their events on
    one worker and their samples on the other; each job is learned exactly once, and both workers learn.
    Then eight more are joined, have two samples each, and one worker stops: the other takes its
    partitions, restores their join states and learns every job with the samples read before the stop."""
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tag = uuid.uuid4().hex[:6]
    horus_id = f"pwtest-horus-pair-{tag}"
    env = {"PHASEWISE_HORUS_WARMUP_S": "0"}
    for i in range(2):
        (tmp_path / f"w{i}").mkdir()
    workers = [Horus(s, tmp_path / f"w{i}", horus_id, **env) for i in range(2)]
    for w in workers:
        w.start()
    try:
        p = make_producer(s)
        spec = JobSpec(model="mlp-32x64x4", dataset="vectors", batch_size=16)
        t0 = time.time() - 60

        def cycle(name: str) -> list[tuple[str, str]]:
            return [(_named(f"{name}-{tag}-", i), _named(f"h{name}-{tag}-", (i + 1) % 8)) for i in range(8)]

        def submit_and_start(jobs: list[tuple[str, str]]) -> None:
            for job, host in jobs:
                for ev in (JobEvent(job=job, ts=t0, kind="submitted", spec=spec),
                           JobEvent(job=job, ts=t0 + 0.5, kind="started", host=host, container="c0")):
                    p.produce(JOB_EVENTS.name, key=job.encode(), partition=zlib.crc32(job.encode()) % 8,
                              value=encode(ev))
            p.flush(10)

        def sample(jobs: list[tuple[str, str]], i: int, cpu: float) -> None:
            for _job, host in jobs:
                p.produce(SAMPLES.name, key=host.encode(), partition=zlib.crc32(host.encode()) % 8,
                          value=encode(HostSamples(host=host, ts=t0 + i, interval_s=1.0, containers=(
                              ContainerSample(container="c0", cpu_cores=cpu, mem_bytes=5e8),))))
            p.flush(10)

        def logged(jobs: list[tuple[str, str]], what: str, among: list[Horus]) -> list[list[str]]:
            """Per worker, the jobs of whom it logged *what* ("learned job {}", "job {} joined")."""
            logs = [w.role.log_tail(4000) for w in among]
            return [[job for job, _h in jobs if what.format(job) in log] for log in logs]

        def wait_logged(jobs: list[tuple[str, str]], what: str, among: list[Horus], feed=None) -> list[list[str]]:
            deadline = time.monotonic() + 120
            while sum(map(len, logged(jobs, what, among))) < len(jobs) and time.monotonic() < deadline:
                if feed is not None:
                    feed()
                time.sleep(0.5)
            return logged(jobs, what, among)

        # bad records on the internal routes topic, in the partition the first job's start is routed to
        first = cycle("pair")
        rkey = f"r-{tag}"
        route_poison = [None, b"[" * 100_000, bytes(range(256)) * 2400,
                        json.dumps({"v": 1, "host": "h", "kind": "started", "ts": 1.0, "event": 5}).encode(),
                        json.dumps({"v": 1, "host": "h", "kind": "teleported", "ts": 1.0}).encode()]
        for v in route_poison:
            p.produce(HORUS_ROUTES.name, key=rkey.encode(), value=v, partition=zlib.crc32(first[0][1].encode()) % 8)
        submit_and_start(first)
        # samples each second of event time until every job is learned (those before its route joined it on
        # its host's worker are not counted: nothing waits on a topic's order)
        ticks = iter(range(1, 1000))
        by = wait_logged(first, "learned job {} ", workers, feed=lambda: sample(first, next(ticks), 0.5))
        assert sorted(by[0] + by[1]) == sorted(job for job, _h in first), [w.role.log_tail(60) for w in workers]
        assert by[0] and by[1], by  # both workers hold partitions: each learned the jobs on its hosts
        assert sum(w.metric("phasewise_horus_samples_off_route_total") for w in workers) == 0
        dls = [decode(DeadLetter, m.value()) for m in
               read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, lambda m: _dl_key(m) == rkey, 5)]
        reasons = sorted(d.reason for d in dls)
        assert len(dls) == 5 and all(d.source_topic == HORUS_ROUTES.name for d in dls), reasons
        assert any("no value" in r for r in reasons) and any("nested too deeply" in r for r in reasons)
        assert any("event: JobEvent: expected a JSON object" in r for r in reasons)
        assert any("'teleported'" in r for r in reasons)

        # eight more, joined, two samples each (one short of an observation), then worker 1 stops
        second = cycle("take")
        submit_and_start(second)
        joined = wait_logged(second, "job {} joined", workers)
        assert sorted(joined[0] + joined[1]) == sorted(job for job, _h in second), joined
        assert joined[1], joined  # worker 1 joined some: the survivor must restore them
        sample(second, 1, 1.0)
        sample(second, 2, 1.0)
        time.sleep(4.0)  # a commit interval: the join states are written with the offsets
        assert workers[1].role.stop(timeout_s=30) == 0, workers[1].role.log_tail()
        ticks = iter(range(3, 1000))
        (by,) = wait_logged(second, "learned job {} ", workers[:1], feed=lambda: sample(second, next(ticks), 4.0))
        assert sorted(by) == sorted(job for job, _h in second), workers[0].role.log_tail(80)
        log = workers[0].role.log_tail(4000)
        for job, _host in second:  # (1 + 1 + 4) / 3: the two samples read before the stop were kept
            line = next(x for x in log.splitlines() if f"learned job {job} " in x)
            assert "cpu_cores=2," in line, line
        logs = "".join(w.role.log_tail(4000) for w in workers)
        for job, _host in first + second:
            assert logs.count(f"learned job {job} ") == 1, job
    finally:
        for w in workers:
            w.role.stop()


def test_a_routes_topic_with_another_partition_count_than_the_samples_is_one_line_and_exit_2(tmp_path):
    """horus routes to the samples topic's partition of a host: a routes topic with another count (made by
    hand, or before the samples topic was resized) is refused at start-up in one line, nothing started."""
    import subprocess
    import sys

    from confluent_kafka.admin import NewTopic

    from phasewise.kit.broker import EmbeddedBroker
    from phasewise.kit.kafka.client import make_admin

    with EmbeddedBroker(log_path=tmp_path / "tansu.log") as b:
        s = Settings.from_env({"bootstrap": b.bootstrap}, env={})
        ensure_topics(s)
        admin = make_admin(s)
        for fut in admin.create_topics([NewTopic(HORUS_ROUTES.name, num_partitions=3)]).values():
            fut.result(30)
        env = {"PATH": "/usr/bin:/bin", "PHASEWISE_BOOTSTRAP": b.bootstrap}
        r = subprocess.run([sys.executable, "-m", "phasewise.cli", "horus", "--data-dir", str(tmp_path / "d"),
                            "--metrics-port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if "error:" in x]
    assert line == (f"phasewise horus: error: topic {HORUS_ROUTES.name} has 3 partitions and the samples topic 8: "
                    "they must be equal (stop the horus workers, delete it: horus creates it again)")
    assert "Traceback" not in r.stderr
