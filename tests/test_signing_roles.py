"""Signed decisions end to end on the module's broker: a real worker signs, a real actuator verifies.

The worker and the actuator share a key file; decisions the worker makes are
applied, while unsigned, wrongly signed (another key, or changed after
signing) and stale ones put on the topic beside them are refused with reasons.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    Actuation,
    ContainerSample,
    DeadLetter,
    Decision,
    HostSamples,
    SchemaError,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring, header_of
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS, SAMPLES

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_signed_decisions_apply_and_unsigned_wrongly_signed_and_stale_ones_are_refused(broker, tmp_path):
    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(48).hex().encode())
    os.chmod(key_file, 0o600)
    ring = Keyring(key_file.read_bytes().strip())
    host = f"sig-{uuid.uuid4().hex[:6]}"
    common = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_SIGNING_KEY_FILE": str(key_file)}
    port = free_port()
    worker = RoleProcess("worker", [], env={
        **common, "PHASEWISE_VPA_TIME_SCALE": "0.001", "PHASEWISE_VPA_UPDATE_MODE": "hysteresis",
        "PHASEWISE_SAFETY_RULES": "false", "PHASEWISE_RECOMMEND_INTERVAL_S": "1", "PHASEWISE_WEB_PORT": "0",
        "PHASEWISE_METRICS_PORT": str(port), "PHASEWISE_DATA_DIR": str(tmp_path / "w"),
        "PHASEWISE_WORKER_ID": f"sig-{uuid.uuid4().hex[:6]}"}, log_path=tmp_path / "worker.log").start()
    actuator = RoleProcess("actuate", ["--backend", "dry-run", "--cgroup-root", str(tmp_path / "no-cgroups")],
                           env={**common, "PHASEWISE_HOST": host, "PHASEWISE_DATA_DIR": str(tmp_path / "a")},
                           log_path=tmp_path / "actuator.log").start()
    reader = make_consumer(s, f"sig-reader-{uuid.uuid4().hex[:6]}")
    reader.assign([TopicPartition(t.name, p, OFFSET_BEGINNING) for t in (DECISIONS, ACTUATIONS, DEAD_LETTERS)
                   for p in range(t.partitions)])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
            try:
                if scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        p = make_producer(s, partitioner=PARTITIONER)
        t0 = time.time() - 30
        for i in range(20):
            hs = HostSamples(host=host, ts=t0 + 0.5 * i, interval_s=0.5, containers=(ContainerSample(
                container="job", cpu_cores=0.2, mem_bytes=3e8, cpu_limit_cores=4.0, mem_limit_bytes=8e9,
                nr_periods=5),))
            p.produce(SAMPLES.name, key=host.encode(), value=encode(hs))
        k = host.encode()

        def forged(container: str, ts: float | None = None) -> bytes:
            return encode(Decision(id=uuid.uuid4().hex, ts=time.time() if ts is None else ts, host=host,
                                   container=container, action="freeze", policy="forged"))
        unsigned, other_key, changed, stale = forged("unsigned"), forged("other-key"), forged("x"), \
            forged("stale", time.time() - 3600)
        p.produce(DECISIONS.name, key=k, value=unsigned)
        p.produce(DECISIONS.name, key=k, value=other_key,
                  headers=Keyring(b"z" * 48).headers(DECISIONS.name, k, other_key))
        p.produce(DECISIONS.name, key=k, value=changed.replace(b'"x"', b'"changed"'),
                  headers=ring.headers(DECISIONS.name, k, changed))
        p.produce(DECISIONS.name, key=k, value=stale, headers=ring.headers(DECISIONS.name, k, stale))
        assert p.flush(10) == 0

        acts: list[Actuation] = []
        letters: list[DeadLetter] = []
        signed_decisions: list[Decision] = []
        deadline = time.monotonic() + 60
        # (the decision and its actuation are on different topics: either may be read first)
        while not (any(a.container == "job" for a in acts) and any(a.container == "stale" for a in acts)
                   and len(letters) >= 3 and signed_decisions):
            assert time.monotonic() < deadline, (acts, letters, actuator.log_tail())
            m = reader.poll(0.2)
            if m is None or m.error():
                continue
            try:
                if m.topic() == ACTUATIONS.name:
                    a = decode(Actuation, m.value())
                    if a.host == host:
                        acts.append(a)
                elif m.topic() == DEAD_LETTERS.name:
                    dl = decode(DeadLetter, m.value())
                    if dl.key == host and dl.source_topic == DECISIONS.name:
                        letters.append(dl)
                else:
                    d = decode(Decision, m.value())
                    if d.host == host and d.policy == "vpa":
                        assert ring.verify(DECISIONS.name, m.key(), m.value(), m.headers()) is None
                        assert header_of(m.headers()).startswith(f"v1:{ring.id}:".encode())
                        signed_decisions.append(d)
            except SchemaError:
                continue  # other tests' hostile records
        job = [a for a in acts if a.container == "job"]
        assert signed_decisions and job[0].status in ("applied", "clamped")
        stale_act = next(a for a in acts if a.container == "stale")
        assert stale_act.status == "rejected" and "decision_max_age_s" in stale_act.message
        reasons = sorted(dl.reason.split("refused: ", 1)[1][:20] for dl in letters)
        assert reasons == ["signed with an unkno", "unsigned: no phasewi", "wrong signature (pha"], reasons
        assert not {a.container for a in acts} & {"unsigned", "other-key", "changed", "x"}
    finally:
        reader.close()
        actuator.stop()
        worker.stop()
