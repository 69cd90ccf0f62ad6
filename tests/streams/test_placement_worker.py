"""``phasewise place`` for real: a Faust worker subprocess, hostile records between valid ones."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest

from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.records import (
    DeadLetter,
    Decision,
    GpuSample,
    HostSamples,
    Interval,
    JobEvent,
    JobRequests,
    JobSpec,
    SchemaError,
    UtilisationPrediction,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, PREDICTIONS, SAMPLES
from tests.streams.test_horus_worker import read_all

pytestmark = [pytest.mark.broker, pytest.mark.slow]
GIB = 1 << 30


def health_answers_of(base: str, role: str) -> None:
    """A job worker's phasewise.kit.observe endpoints once it is ready: live, ready, its build_info."""
    import urllib.request

    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(base + path, timeout=5) as r:
            assert (r.status, r.read()) == (200, b"ok\n"), path
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        assert f'role="{role}"' in r.read().decode()


def test_place_decisions_between_hostile_records(broker, tmp_path):
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.procs import RoleProcess

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tag = uuid.uuid4().hex[:6]
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": s.kafka.bootstrap, "PHASEWISE_PLACE_PREDICTION_WAIT_S": "1"}
    role = RoleProcess("place", ["--place-id", f"pwtest-place-{tag}", "--data-dir", str(tmp_path / "d"),
                                 "--metrics-port", str(port)], env=env, log_path=tmp_path / "place.log")
    role.start()
    deadline = time.monotonic() + 150
    while True:
        assert role.alive() and time.monotonic() < deadline, "place not ready:\n" + role.log_tail()
        try:
            if scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_place_ready", 0) == 1.0:
                break
        except OSError:
            pass
        time.sleep(0.3)
    assert role.alive(), role.log_tail()
    health_answers_of(f"http://127.0.0.1:{port}", "place")
    try:
        p = make_producer(s)
        key = f"k-{tag}".encode()
        poison = [None, b"[" * 100_000, bytes(range(256)) * 2400]
        wrong = {JOB_EVENTS.name: {"v": 1, "job": "x", "ts": "yesterday", "kind": "submitted"},
                 PREDICTIONS.name: {"v": 1, "job": "x", "ts": 1.0, "model_version": "seven"},
                 SAMPLES.name: {"v": 1, "host": 5, "ts": 1.0, "interval_s": 1.0}}
        host = f"node-{tag}"
        # a node large enough for the jobs that other tests on this broker submitted before (the worker
        # reads the job events from the start and places those too)
        sample = encode(HostSamples(host=host, ts=time.time(), interval_s=1.0, host_cpu_count=1024, host_cpu_cores=1.0,
                                    host_mem_bytes=4 * GIB, host_mem_total_bytes=4096 * GIB,
                                    gpus=tuple(GpuSample(index=i, uuid=f"GPU-{i}", util=10.0, mem_used_bytes=GIB,
                                                         mem_total_bytes=16 * GIB) for i in range(64))))
        spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32,
                       requests=JobRequests(cpu_cores=2.0, mem_bytes=4 * GIB, gpus=0.5, gpu_mem_bytes=4 * GIB))
        a, b = f"a-{tag}", f"b-{tag}"
        iv = Interval(mean=30.0, lo=20.0, hi=40.0)
        pred = encode(UtilisationPrediction(job=a, ts=1.0, model_version=3, gpu_util=iv, gpu_mem_bytes=iv,
                                            cpu_cores=iv, mem_bytes=iv, coverage=0.8))
        valid = {SAMPLES.name: sample, JOB_EVENTS.name: encode(JobEvent(job=a, ts=1.0, kind="submitted", spec=spec)),
                 PREDICTIONS.name: pred}
        ahead = time.time() + 1e7  # valid records stamped ~116 days ahead: refused by the event-time rule
        future = {SAMPLES.name: encode(dataclasses.replace(decode(HostSamples, sample), ts=ahead)),
                  JOB_EVENTS.name: encode(JobEvent(job=f"c-{tag}", ts=ahead, kind="submitted", spec=spec)),
                  PREDICTIONS.name: encode(dataclasses.replace(decode(UtilisationPrediction, pred), ts=ahead))}
        for topic in (SAMPLES.name, JOB_EVENTS.name, PREDICTIONS.name):
            for v in [*poison, json.dumps(wrong[topic]).encode(), future[topic], valid[topic]]:
                p.produce(topic, key=key, value=v, partition=0)
            p.flush(10)
        p.produce(JOB_EVENTS.name, key=key, value=encode(JobEvent(job=b, ts=2.0, kind="submitted", spec=spec,
                                                                  priority=2)), partition=0)
        p.flush(10)
        def for_ours(m) -> bool:
            return m.key() == host.encode() and decode(Decision, m.value()).container in (a, b)

        # each job takes half a GPU: its share decision comes before its place decision
        got = [decode(Decision, m.value()) for m in read_all(s, DECISIONS.name, DECISIONS.partitions, for_ours, 4)]
        shares = [d for d in got if d.action == "share"]
        ds = {d.container: d for d in got if d.action == "place"}
        assert set(ds) == {a, b}, role.log_tail(80)
        assert {d.container for d in shares} == {a, b} and all(d.details["sm_percent"] >= 50 for d in shares)
        for d in shares:
            assert got.index(d) < got.index(ds[d.container]) and d.details["device"] == ds[d.container].details[
                "device"][0] and d.details["mem_limit_bytes"] == 4 * GIB
        assert all(d.action == "place" and d.host == host and len(d.details["device"]) == 1 for d in ds.values())
        assert "model v3" in ds[a].reason and "no prediction" in ds[b].reason

        def ours(m) -> bool:
            try:
                return decode(DeadLetter, m.value()).key == f"k-{tag}"
            except SchemaError:
                return False

        dls = [decode(DeadLetter, m.value()) for m in read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions,
                                                                 ours, 15)]
        assert len(dls) == 15 and {d.source_topic for d in dls} == {SAMPLES.name, JOB_EVENTS.name, PREDICTIONS.name}
        assert sum("ahead of the worker clock" in d.reason for d in dls) == 3, [d.reason for d in dls]
        assert role.alive()
    finally:
        assert role.stop(timeout_s=30) == 0, role.log_tail()


def test_beyond_place_max_waiting_jobs_the_job_of_lowest_rank_is_dead_lettered_naming_the_setting(broker, tmp_path):
    """A real place worker whose waiting jobs are capped at 2: of four jobs that cannot be placed, the two of
    lowest rank (priority, then submission) are refused on the dead-letter topic with the reason; the
    others wait, and the first placed when room comes is the one of highest priority."""
    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.procs import RoleProcess

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    tag = uuid.uuid4().hex[:6]
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": s.kafka.bootstrap, "PHASEWISE_PLACE_PREDICTION_WAIT_S": "0",
           "PHASEWISE_PLACE_MAX_WAITING_JOBS": "2"}
    role = RoleProcess("place", ["--place-id", f"pwtest-cap-{tag}", "--data-dir", str(tmp_path / "d"),
                                 "--metrics-port", str(port)], env=env, log_path=tmp_path / "place.log")
    role.start()
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 150
    while True:
        assert role.alive() and time.monotonic() < deadline, "place not ready:\n" + role.log_tail()
        try:
            if scrape(url).get("phasewise_place_ready", 0) == 1.0:
                break
        except OSError:
            pass
        time.sleep(0.3)
    try:
        p = make_producer(s)
        host = f"wide-{tag}"  # the one node with 1,500 free cores (the jobs other tests left need a few)
        p.produce(SAMPLES.name, key=host.encode(), value=encode(HostSamples(
            host=host, ts=time.time(), interval_s=1.0, host_cpu_count=2048, host_cpu_cores=1.0,
            host_mem_bytes=4 * GIB, host_mem_total_bytes=4096 * GIB)))
        p.flush(10)
        spec = JobSpec(model="resnet18", dataset="cifar10", batch_size=32,
                       requests=JobRequests(cpu_cores=1500.0, mem_bytes=GIB, gpus=0.0))
        jobs = {f"{n}-{tag}": prio for n, prio in (("big", 0), ("w1", 0), ("w2", 3), ("w3", 1), ("w4", 0))}
        for i, (job, prio) in enumerate(jobs.items()):
            p.produce(JOB_EVENTS.name, key=job.encode(), value=encode(JobEvent(
                job=job, ts=time.time() - 60 + i, kind="submitted", spec=spec, priority=prio)))
            p.flush(10)
            if i == 0:  # the first takes the node: the others wait for it
                read_all(s, DECISIONS.name, DECISIONS.partitions,
                         lambda m, first=job: decode(Decision, m.value()).container == first, 1)

        def refused(m) -> bool:
            try:
                return decode(DeadLetter, m.value()).key in jobs
            except SchemaError:
                return False

        dls = {d.key: d for d in (decode(DeadLetter, m.value())
                                  for m in read_all(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions, refused, 2))}
        assert set(dls) == {f"w1-{tag}", f"w4-{tag}"}, role.log_tail(40)
        for d in dls.values():
            assert d.source_topic == JOB_EVENTS.name and "place_max_waiting_jobs 2" in d.reason
            assert decode(JobEvent, d.payload.encode()).job == d.key  # the refused job's submission, whole
        assert scrape(url)['phasewise_place_dead_letters_total{kind="capacity"}'] == 2.0
        p.produce(JOB_EVENTS.name, key=f"big-{tag}".encode(),
                  value=encode(JobEvent(job=f"big-{tag}", ts=time.time(), kind="finished")))
        p.flush(10)
        (m,) = read_all(s, DECISIONS.name, DECISIONS.partitions,
                        lambda m: decode(Decision, m.value()).container in (f"w2-{tag}", f"w3-{tag}"), 1)
        assert decode(Decision, m.value()).container == f"w2-{tag}"  # priority 3 first
        assert role.alive()
    finally:
        assert role.stop(timeout_s=30) == 0, role.log_tail()
