"""Horus learning in the live flow, through the real roles on a private broker.

Real jobs of two kinds (two models, each a process burning its own share of a CPU), submitted signed
and placed by signed place decisions, are started by ``phasewise actuate`` (cgroup backend) in their
own cgroups, which announces them (``started``) and reports how they end (``finished``, ``failed``,
``terminated``); ``phasewise produce`` samples their cgroups. ``phasewise horus`` predicts each job at
submission, joins its samples after the loading phase and learns it once: after ``horus_observe_s``
of running samples, or at its end when that comes first; each learned job's prediction is published
again with what was observed and the log error, and the prediction error falls over the similar
jobs. A second horus worker, started afterwards with its own group and no state, reads the shared
snapshot and predicts the next job with what the first learned; a forged (unsigned) snapshot and an
unsigned end are dead letters.
"""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.job_signing import sign_event, start_details
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    DeadLetter,
    Decision,
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
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, JOB_EVENTS, MODELS, PREDICTIONS, SAMPLES
from phasewise.models.horus.snapshot import SNAPSHOT_NAME, observations_of, snapshot_of
from tests.actuators.conftest import job_python
from tests.conftest import requires_root
from tests.job_keys import KEY as SUBMITTER
from tests.job_keys import write_public
from tests.streams.test_horus_worker import Horus

pytestmark = [pytest.mark.broker, pytest.mark.slow]

KEY = b"h" * 48
#: a share of one CPU (argv 1), busy then idle every 50 ms, for argv 2 seconds, then exit status argv 3
BURN = """
import sys, time
duty, run_s, code = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
end = time.monotonic() + run_s
while time.monotonic() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05 * duty:
        pass
    time.sleep(0.05 * (1 - duty))
sys.exit(code)
"""


class Reader:
    """One topic read from its beginning, its records kept."""

    def __init__(self, settings: Settings, topic) -> None:
        self.c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
        self.c.assign([TopicPartition(topic.name, p, OFFSET_BEGINNING) for p in range(topic.partitions)])
        self.got: list = []

    def until(self, pred, what: str, timeout_s: float = 60.0, logs=()):
        seen = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.got[seen:]:
                if pred(m):
                    return m
            seen = len(self.got)
            m = self.c.poll(0.2)
            if m is not None and not m.error():
                self.got.append(m)
        raise TimeoutError(f"{what} not within {timeout_s} s\n" + "\n".join(r.log_tail(40) for r in logs))


def prediction(m) -> UtilisationPrediction | None:
    try:
        return decode(UtilisationPrediction, m.value())
    except SchemaError:
        return None


#: the two kinds of job: a model and the share of a CPU its process burns
SMALL, LARGE = ("mlp-32x64x4", 0.15), ("mlp-256x512x10", 0.6)


def submitted(job: str, model: str, command: tuple[str, ...]) -> JobEvent:
    """A signed submission of *job*."""
    return sign_event(SUBMITTER, JobEvent(job=job, ts=time.time(), kind="submitted", spec=JobSpec(
        model=model, dataset="vectors", batch_size=16, command=command)))


def job_event(m) -> JobEvent | None:
    try:
        return decode(JobEvent, m.value())
    except SchemaError:
        return None


@requires_root
def test_horus_learns_each_job_once_in_the_live_flow_and_a_second_worker_predicts_with_it(broker, tmp_path):
    python = job_python()
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    ring = Keyring(KEY)
    trusted = tmp_path / "submitters"
    trusted.mkdir(mode=0o755)
    write_public(trusted / "alice.pub")
    tag = uuid.uuid4().hex[:6]
    host = f"live-{tag}"
    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwhorus-{tag}")
    common = {"PHASEWISE_BOOTSTRAP": s.kafka.bootstrap, "PHASEWISE_HOST": host,
              "PHASEWISE_SIGNING_KEY_FILE": str(key_file), "PHASEWISE_CGROUP_ROOT": "/sys/fs/cgroup",
              "PHASEWISE_CGROUP_PREFIX": layout.prefix}
    producer = RoleProcess("produce", [], env={**common, "PHASEWISE_INTERVAL_S": "0.5"},
                           log_path=tmp_path / "producer.log")
    actuator = RoleProcess("actuate", ["--backend", "cgroup"], env={
        **common, "PHASEWISE_DATA_DIR": str(tmp_path / "a"), "PHASEWISE_ACTUATOR_START_JOBS": "true",
        "PHASEWISE_JOB_TRUSTED_SUBMITTERS": str(trusted)}, log_path=tmp_path / "actuator.log")
    horus_env = {"PHASEWISE_SIGNING_KEY_FILE": str(key_file), "PHASEWISE_HORUS_SHARE_MODEL": "true",
                 "PHASEWISE_HORUS_WARMUP_S": "1", "PHASEWISE_HORUS_OBSERVE_S": "4"}
    first = Horus(s, tmp_path, f"pwtest-horus-a-{tag}", **horus_env)
    roles: list = [producer, actuator, first.role]
    p = make_producer(s, partitioner=PARTITIONER)  # the actuator reads its host key's partition
    preds, samples, events = Reader(s, PREDICTIONS), Reader(s, SAMPLES), Reader(s, JOB_EVENTS)

    def send(topic, key: str, value: bytes, *, sign: bool) -> None:
        k = key.encode()
        p.produce(topic.name, key=k, value=value, headers=ring.headers(topic.name, k, value) if sign else None)
        p.flush(10)

    def decide(action: str, container: str, details: dict) -> None:
        d = Decision(id=f"{action}-{container}", ts=time.time(), host=host, container=container, action=action,
                     policy="test", reason="test", details=details)
        send(DECISIONS, host, encode(d), sign=True)

    def learned(job: str):
        return lambda m: m.key() == job.encode() and (x := prediction(m)) is not None and bool(x.observed)

    def ended(job: str, kind: str):
        return lambda m: m.key() == job.encode() and (e := job_event(m)) is not None and e.kind == kind

    def run_job(i: int, end: str, kind: tuple[str, float]) -> UtilisationPrediction:
        """Submit, predict, place; the actuator starts it and reports its end: ``finished`` (it runs
        8 s, learned at observe_s before it ends), ``failed`` (exit status 1 after 3.5 s: learned at its
        end) or ``terminated`` (a terminate decision after its fourth steady sample)."""
        job = f"j{i}-{tag}"
        run_s, code = {"finished": (8.0, 0), "failed": (3.5, 1), "terminated": (60.0, 0)}[end]
        model, duty = kind
        ev = submitted(job, model, (python, "-c", BURN, str(duty), str(run_s), str(code)))
        send(JOB_EVENTS, job, encode(ev), sign=False)
        preds.until(lambda m: m.key() == job.encode(), f"{job}'s prediction", logs=roles)
        decide("place", job, {"cpuset": None, "device": [], **start_details(ev)})
        started = job_event(events.until(ended(job, "started"), f"{job} started", logs=roles))
        assert started.host == host and started.container == job and started.pid
        if end == "terminated":
            t0 = started.ts

            def steady(m) -> bool:
                hs = decode_host_samples(m.value())
                return hs.host == host and hs.ts >= t0 + 2.2 and any(c.container == job for c in hs.containers)

            samples.until(steady, f"{job}'s samples", logs=roles)
            decide("terminate", job, {"grace_s": 0})
        events.until(ended(job, end), f"{job} {end}", logs=roles)
        return prediction(preds.until(learned(job), f"{job} learned", logs=roles))

    try:
        for r in roles[:2]:
            r.start()
        first.start()
        ends = ["finished", "finished", "failed", "finished", "terminated", "finished"]
        kinds = [SMALL, LARGE] * 3
        done = [run_job(i, e, k) for i, (e, k) in enumerate(zip(ends, kinds))]
        errors = [x.log_error["cpu_cores"] for x in done]
        observed = [x.observed["cpu_cores"] for x in done]
        print("cpu_cores log error per job:", [round(e, 3) for e in errors],
              "observed:", [round(x, 3) for x in observed])
        n = len(done)
        assert [x.model_version for x in done] == list(range(n))  # each predicted after the one before was learned
        assert [x.first_sight for x in done] == [True, True] + [False] * (n - 2)
        small, large = observed[0::2], observed[1::2]
        assert max(small) < min(large), observed  # the two levels
        assert sum(errors[-2:]) < sum(errors[:2]), errors  # the error falls over the similar jobs
        # each learned once: one outcome each, signed
        assert first.wait_metric("phasewise_horus_jobs_learned_total", n) == n
        assert first.metric('phasewise_horus_prediction_log_error_count{target="cpu_cores"}') == n
        assert first.metric('phasewise_horus_last_prediction_log_error{target="cpu_cores"}') == pytest.approx(
            errors[-1], abs=1e-9)
        outcomes = [m for m in preds.got if (x := prediction(m)) is not None and x.observed]
        assert sorted(prediction(m).job for m in outcomes) == sorted(x.job for x in done)
        assert all(ring.verify(PREDICTIONS.name, m.key(), m.value(), m.headers()) is None for m in outcomes)

        # the shared model: signed snapshots on the models topic, the newest holding the jobs in order
        snaps = Reader(s, MODELS)
        last = snaps.until(lambda m: m.key() == SNAPSHOT_NAME.encode()
                           and decode(ModelSnapshot, m.value()).samples_seen == n, f"the snapshot of {n} jobs")
        assert ring.verify(MODELS.name, last.key(), last.value(), last.headers()) is None
        assert [o["job"] for o in observations_of(decode(ModelSnapshot, last.value()))] == [x.job for x in done]
        snaps.c.close()

        # a forged snapshot (unsigned, claiming a job of its own at 50 cores) before the second worker starts
        forged = observations_of(decode(ModelSnapshot, last.value()))[:1]
        forged = [{**forged[0], "job": f"evil-{tag}", "o": {"cpu_cores": 50.0}}]
        send(MODELS, SNAPSHOT_NAME, encode(snapshot_of(forged, 99, time.time())), sign=False)

        # a second horus worker (its own group, no state) predicts the next job with what the first learned
        assert first.role.stop(timeout_s=30) == 0, first.role.log_tail()
        second = Horus(s, tmp_path, f"pwtest-horus-b-{tag}", **horus_env)
        roles[2] = second.role
        second.start()
        job = f"j{n}-{tag}"
        ev = submitted(job, SMALL[0], ("/bin/true",))
        send(JOB_EVENTS, job, encode(ev), sign=False)
        send(JOB_EVENTS, job, encode(JobEvent(job=job, ts=time.time(), kind="finished", exit_code=0)), sign=False)
        nxt = prediction(preds.until(lambda m: m.key() == job.encode() and prediction(m).model_version >= n,
                                     f"{job}'s prediction by the second worker", logs=roles))
        assert nxt.model_version == n and not nxt.first_sight, nxt
        mean_small = sum(small) / len(small)
        assert abs(nxt.cpu_cores.mean - mean_small) < abs(done[0].cpu_cores.mean - mean_small), (
            nxt.cpu_cores, mean_small)
        assert second.metric("phasewise_horus_shared_jobs_learned_total") == n
        assert second.metric("phasewise_horus_jobs_learned_total") == 0  # the replayed jobs are not learned again
        dls = Reader(s, DEAD_LETTERS)
        for why in ("Horus ModelSnapshot refused: unsigned", f"JobEvent finished {job} refused: unsigned"):
            dls.until(lambda m, why=why: why in decode(DeadLetter, m.value()).reason, why, logs=roles)
        dls.c.close()
        assert second.metric('phasewise_horus_dead_letters_total{kind="signature"}') >= 2
    finally:
        for r in roles:
            r.stop()
        for c in layout.containers():
            layout.remove(c)
        cs = layout.controller_root("cpuset") / layout.prefix
        for d in sorted(cs.glob("*"), reverse=True) if cs.exists() else []:
            if d.is_dir():
                d.rmdir()
        if cs.exists():
            cs.rmdir()
        for c in layout.controllers():
            try:
                layout.base(c).rmdir()
            except OSError:
                pass
        for r in (preds, samples, events):
            r.c.close()
