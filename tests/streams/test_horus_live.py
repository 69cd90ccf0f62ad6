"""Horus learning in the live flow, through the real roles on a private broker.

Real jobs (processes burning a share of a CPU in their own cgroups) are sampled by ``phasewise produce``;
the test plays the actuator's part of the lifecycle (signed ``started`` and terminal events, as the
actuator publishes them). ``phasewise horus`` predicts each job at submission, joins its samples after
the loading phase and learns it once: after ``horus_observe_s`` of running samples, or at its end
(``failed``, ``terminated``) when that comes first; each learned job's prediction is published again
with what was observed and the log error, and the prediction error falls over the similar jobs. A
second horus worker, started afterwards with its own group and no state, reads the shared snapshot and
predicts the next job with what the first learned.
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.procs import ManagedProcess, RoleProcess
from phasewise.kit.records import (
    JobEvent,
    JobSpec,
    ModelSnapshot,
    SchemaError,
    UtilisationPrediction,
    decode,
    decode_host_samples,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import JOB_EVENTS, MODELS, PREDICTIONS, SAMPLES
from phasewise.models.horus.snapshot import SNAPSHOT_NAME, observations_of
from tests.conftest import private_broker_fixture, requires_root
from tests.streams.test_horus_worker import Horus

pytestmark = [pytest.mark.broker, pytest.mark.slow]

broker = private_broker_fixture()

KEY = b"h" * 48
#: a share of one CPU, busy then idle every 50 ms
BURN = """
import sys, time
duty = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05 * duty:
        pass
    time.sleep(0.05 * (1 - duty))
"""


class Reader:
    """One topic read from its beginning, the records kept by key."""

    def __init__(self, settings: Settings, topic) -> None:
        self.c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(topic.name, p, OFFSET_BEGINNING) for p in range(topic.partitions)])
        self.got: list = []

    def until(self, pred, what: str, timeout_s: float = 60.0, logs=()):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.got:
                if pred(m):
                    return m
            m = self.c.poll(0.2)
            if m is not None and not m.error():
                self.got.append(m)
        raise TimeoutError(f"{what} not within {timeout_s} s\n" + "\n".join(r.log_tail(40) for r in logs))


def prediction(m) -> UtilisationPrediction | None:
    try:
        return decode(UtilisationPrediction, m.value())
    except SchemaError:
        return None


@requires_root
def test_horus_learns_each_job_once_in_the_live_flow_and_a_second_worker_predicts_with_it(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    ring = Keyring(KEY)
    tag = uuid.uuid4().hex[:6]
    host = f"live-{tag}"
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwhorus-{tag}")
    signed = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file), "PHASEWISE_HORUS_SHARE_MODEL": "true",
              "PHASEWISE_HORUS_WARMUP_S": "1", "PHASEWISE_HORUS_OBSERVE_S": "3"}
    producer = RoleProcess("produce", [], env={
        "PHASEWISE_BOOTSTRAP": s.kafka.bootstrap, "PHASEWISE_HOST": host, "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup",
        "PHASEWISE_CGROUP_PREFIX": layout.prefix, "PHASEWISE_INTERVAL_S": "0.5",
        "PHASEWISE_SIGNING_KEY_FILE": str(key_file)}, log_path=tmp_path / "producer.log")
    first = Horus(s, tmp_path, f"pwtest-horus-a-{tag}", **signed)
    roles: list = [producer, first.role]
    burners: dict[str, ManagedProcess] = {}
    p = make_producer(s)
    preds, samples = Reader(s, PREDICTIONS), Reader(s, SAMPLES)
    spec = JobSpec(model="mlp-32x64x4", dataset="vectors", batch_size=16)

    def publish(ev: JobEvent, *, sign: bool) -> None:
        k, v = ev.job.encode(), encode(ev)
        p.produce(JOB_EVENTS.name, key=k, value=v, headers=ring.headers(JOB_EVENTS.name, k, v) if sign else None)
        p.flush(10)

    def start(job: str, duty: float) -> int:
        layout.create(job)
        b = ManagedProcess(job, [sys.executable, "-c", BURN, str(duty)], env={"PATH": "/usr/bin:/bin"},
                           log_path=tmp_path / f"{job}.log").start()
        layout.attach(job, b.pid)
        burners[job] = b
        return b.pid

    def end(job: str) -> None:
        burners.pop(job).stop()
        layout.remove(job)

    def run_job(i: int, terminal: str, duty: float = 0.3) -> UtilisationPrediction:
        """Submit, predict, start, sample; the job's end comes once it was learned (after observe_s) or,
        for an early terminal state, after four steady samples; its learned outcome is returned."""
        job = f"j{i}-{tag}"
        publish(JobEvent(job=job, ts=time.time(), kind="submitted", spec=spec), sign=False)
        preds.until(lambda m: m.key() == job.encode(), f"{job}'s prediction", logs=roles)
        pid = start(job, duty)
        t0 = time.time()
        publish(JobEvent(job=job, ts=t0, kind="started", host=host, container=job, pid=pid), sign=True)
        if terminal == "finished":  # runs until horus learned it, then ends
            preds.until(lambda m: m.key() == job.encode() and (x := prediction(m)) is not None and x.observed,
                        f"{job} learned", logs=roles)
        else:  # ends before observe_s: learned at its end

            def steady(m) -> bool:
                hs = decode_host_samples(m.value())
                return hs.host == host and hs.ts >= t0 + 2.2 and any(c.container == job for c in hs.containers)

            samples.until(steady, f"{job}'s samples", logs=roles)
        end(job)
        extra = {"exit_code": 1} if terminal == "failed" else {"signal": "SIGTERM"} if terminal == "terminated" else {}
        publish(JobEvent(job=job, ts=time.time(), kind=terminal, host=host, container=job, run_s=time.time() - t0,
                         **extra), sign=True)
        m = preds.until(lambda m: m.key() == job.encode() and (x := prediction(m)) is not None and x.observed,
                        f"{job} learned at its end", logs=roles)
        return prediction(m)

    try:
        producer.start()
        first.start()
        ends = ["finished", "finished", "failed", "finished", "terminated"]
        learned = [run_job(i, e) for i, e in enumerate(ends)]
        errors = [x.log_error["cpu_cores"] for x in learned]
        print("cpu_cores log error per job:", [round(e, 3) for e in errors],
              "observed:", [round(x.observed["cpu_cores"], 3) for x in learned])
        assert all(x.model_version == i for i, x in enumerate(learned)), [x.model_version for x in learned]
        assert learned[0].first_sight and not learned[-1].first_sight
        assert sum(errors[-2:]) / 2 < errors[0], errors  # the error falls over the similar jobs
        # each learned once: 5 learned, and the published outcome of each job only once
        first.wait_metric("phasewise_horus_jobs_learned_total", 5)
        assert first.metric("phasewise_horus_jobs_learned_total") == 5
        assert first.metric('phasewise_horus_prediction_log_error_count{target="cpu_cores"}') == 5
        assert first.metric('phasewise_horus_last_prediction_log_error{target="cpu_cores"}') == pytest.approx(
            errors[-1], abs=1e-9)
        outcomes = [m for m in preds.got if (x := prediction(m)) is not None and x.observed]
        assert sorted(prediction(m).job for m in outcomes) == sorted(x.job for x in learned)
        assert all(ring.verify(PREDICTIONS.name, m.key(), m.value(), m.headers()) is None for m in outcomes)

        # the shared model: signed snapshots on the models topic, the last holding the five jobs
        snaps = Reader(s, MODELS)
        last = snaps.until(lambda m: m.key() == SNAPSHOT_NAME.encode()
                           and decode(ModelSnapshot, m.value()).samples_seen == 5, "the snapshot of 5 jobs")
        assert ring.verify(MODELS.name, last.key(), last.value(), last.headers()) is None
        assert [o["job"] for o in observations_of(decode(ModelSnapshot, last.value()))] == [x.job for x in learned]

        # a second horus worker (its own group, no state) predicts the next job with what the first learned
        assert first.role.stop(timeout_s=30) == 0, first.role.log_tail()
        second = Horus(s, tmp_path, f"pwtest-horus-b-{tag}", **signed)
        roles[1] = second.role
        second.start()
        job = f"j5-{tag}"
        publish(JobEvent(job=job, ts=time.time(), kind="submitted", spec=spec), sign=False)
        m = preds.until(lambda m: m.key() == job.encode(), f"{job}'s prediction by the second worker", logs=roles)
        nxt = prediction(m)
        assert nxt.model_version == 5 and not nxt.first_sight, nxt
        mean_observed = sum(x.observed["cpu_cores"] for x in learned) / 5
        first_error = abs(learned[0].cpu_cores.mean - mean_observed)
        assert abs(nxt.cpu_cores.mean - mean_observed) < first_error, (nxt.cpu_cores, mean_observed)
        assert second.metric("phasewise_horus_shared_jobs_learned_total") == 5
        assert second.metric("phasewise_horus_jobs_learned_total") == 0  # the old jobs are not learned again
    finally:
        for r in roles:
            r.stop()
        for job in list(burners):
            end(job)
        for c in layout.controllers():
            try:
                layout.base(c).rmdir()
            except OSError:
                pass
        preds.c.close()
        samples.c.close()
