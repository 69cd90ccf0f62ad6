"""Known-job priors through real workers: one worker publishes the profiles of a job's runs, another (its own
group, no state of its own) reads them from the profiles topic and limits the job's next run at once."""

from __future__ import annotations

import time
import uuid

import pytest

from phasewise.kit.kafka.client import ensure_topics, make_producer
from phasewise.kit.records import (
    ContainerSample,
    DeadLetter,
    Decision,
    ExecutionProfile,
    HostSamples,
    SchemaError,
    WorkloadPolicy,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DEAD_LETTERS, DECISIONS, PROFILES, SAMPLES
from tests.streams.test_worker import Reader, Worker

pytestmark = [pytest.mark.broker, pytest.mark.slow]

MIB = 2**20
PRIORS = {"PHASEWISE_SAFETY_RULES": "true", "PHASEWISE_PRIOR_MIN_RUNS": "2", "PHASEWISE_PRIOR_MIN_RUN_S": "10",
          "PHASEWISE_PRIOR_PROFILE_INTERVAL_S": "5", "PHASEWISE_PRIOR_MARGIN": "0.1"}


def tick(host: str, ts: float, runs: dict[str, tuple[float, float]], signature: str) -> bytes:
    return encode(HostSamples(host=host, ts=ts, interval_s=1.0, containers=tuple(
        ContainerSample(container=name, cpu_cores=cpu, mem_bytes=mem, nr_periods=10,
                        workload=WorkloadPolicy(mode="apply", signature=signature))
        for name, (cpu, mem) in runs.items())))


def profile_of(run: str):
    def pred(m) -> bool:
        try:
            p = decode(ExecutionProfile, m.value())
        except SchemaError:
            return False
        return p.container == run and p.ts - p.start >= 10
    return pred


def test_a_run_of_a_known_job_starts_from_the_runs_another_worker_saw(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    host, sig = f"h-{uuid.uuid4().hex[:6]}", f"lm-{uuid.uuid4().hex[:6]}"
    t0 = time.time() - 600
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Worker(s, tmp_path / "a", f"pwtest-prior-a-{uuid.uuid4().hex[:6]}")
    first.role.env.update(PRIORS)
    first.start()
    p = make_producer(s)
    try:
        for k in range(30):  # two runs of the job, 30 s each
            p.produce(SAMPLES.name, key=host.encode(),
                      value=tick(host, t0 + k, {"run-1": (1.0, 400 * MIB), "run-2": (1.5, 500 * MIB)}, sig))
        p.flush(10)
        profiles = Reader(s, PROFILES.name, PROFILES.partitions)
        for run in ("run-1", "run-2"):
            profiles.wait_for(profile_of(run), what=f"a profile of {run}")
        got = [decode(ExecutionProfile, m.value()) for m in profiles.seen if profile_of("run-2")(m)]
        assert max(g.mem_peak_bytes for g in got) == 500 * MIB and got[0].signature == sig
        profiles.close()
        assert first.metric('phasewise_worker_profiles_total{way="published"}') >= 2
    finally:
        first.role.stop()
    # a record on the profiles topic that is no profile: the next worker dead-letters it and goes on
    p.produce(PROFILES.name, key=b"bad", value=b'{"signature": "x"}')
    p.flush(10)

    # the second worker serves another host only (worker_hosts): what it knows of the first two runs can
    # only come from the profiles topic
    other = f"{host}-b"
    second = Worker(s, tmp_path / "b", f"pwtest-prior-b-{uuid.uuid4().hex[:6]}")
    second.role.env.update({**PRIORS, "PHASEWISE_WORKER_HOSTS": other})
    second.start()
    try:
        decisions = Reader(s, DECISIONS.name, DECISIONS.partitions)

        def for_run3(m) -> bool:
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                return False
            return d.host == other and d.container == "run-3"

        got = []
        for k in range(120):  # a third run on the other host, a tick at a time until it is decided
            p.produce(SAMPLES.name, key=other.encode(), value=tick(other, t0 + 40 + k, {"run-3": (0.8, 300 * MIB)},
                                                                  sig))
            p.flush(10)
            try:
                got = decisions.wait_for(for_run3, timeout_s=0.5, what="a decision for run-3")
                break
            except TimeoutError:
                continue
        assert got, "no decision for run-3:\n" + second.role.log_tail()
        d = decode(Decision, got[0].value())
        decisions.close()
        assert d.details["prior"]["runs"] == 2 and d.details["prior"]["signature"] == sig
        assert d.cpu_limit_cores == pytest.approx(1.65) and d.mem_limit_bytes == pytest.approx(550 * MIB, abs=1)
        assert d.reason.startswith(f"prior of 2 earlier runs of {sig}")
        assert second.metric("phasewise_worker_prior_decisions_total") >= 1
        assert second.metric('phasewise_worker_profiles_total{way="read"}') >= 2
        dead = Reader(s, DEAD_LETTERS.name, DEAD_LETTERS.partitions)
        letters = dead.wait_for(lambda m: decode(DeadLetter, m.value()).source_topic == PROFILES.name,
                                what="the bad profile's dead letter")
        assert "ExecutionProfile" in decode(DeadLetter, letters[0].value()).reason
        dead.close()
    finally:
        second.role.stop()
