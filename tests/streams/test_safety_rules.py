"""The safety rules in a real ``phasewise worker`` (both policies), on the module's broker.

The rules themselves, in the worker's step under both policies, are checked in
a simulated closed loop by tests/models/safety/test_safety_rules.py.
"""

from __future__ import annotations

import pytest

from phasewise.kit.records import ContainerSample, Decision, HostSamples
from phasewise.kit.settings import Settings

MIB = 2**20


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["vpa", "phase"])
def test_a_real_worker_bounds_its_decisions_by_the_rules_and_counts_them(broker, tmp_path, policy):
    """``phasewise worker`` with the rules on (scaled down): an idle container under a 4-core, 2 GiB
    limit is cut only after the minimum history, by at most the step, and the metric counts it."""
    import time
    import uuid

    from phasewise.apps.bench.harness import scrape
    from phasewise.kit.broker import free_port
    from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer
    from phasewise.kit.procs import RoleProcess
    from phasewise.kit.records import SchemaError, decode, encode
    from phasewise.kit.topics import DECISIONS, SAMPLES

    s = Settings.from_env({"bootstrap": broker.bootstrap}, env={})
    ensure_topics(s)
    port = free_port()
    env = {"PHASEWISE_BOOTSTRAP": broker.bootstrap, "PHASEWISE_POLICY": policy, "PHASEWISE_VPA_TIME_SCALE": "0.001",
           "PHASEWISE_RECOMMEND_INTERVAL_S": "1", "PHASEWISE_SAFETY_MIN_HISTORY_S": "8",
           "PHASEWISE_SAFETY_COOLDOWN_S": "4", "PHASEWISE_SAFETY_MAX_DECREASE": "0.25",
           "PHASEWISE_WEB_PORT": "0", "PHASEWISE_METRICS_PORT": str(port), "PHASEWISE_DATA_DIR": str(tmp_path),
           "PHASEWISE_WORKER_ID": f"safety-{uuid.uuid4().hex[:6]}"}
    worker = RoleProcess("worker", [], env=env, log_path=tmp_path / "worker.log").start()
    host = f"safe-{uuid.uuid4().hex[:6]}"
    consumer = make_consumer(s, f"safety-reader-{uuid.uuid4().hex[:6]}")
    consumer.subscribe([DECISIONS.name])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
            try:
                if scrape(f"http://127.0.0.1:{port}/metrics").get("phasewise_worker_ready") == 1.0:
                    break
            except OSError:  # not serving yet
                pass
            time.sleep(0.2)
        p = make_producer(s)
        t0 = time.time() - 60
        for i in range(40):  # 20 s of event time at 0.1 cores / 200 MiB under 4 cores / 2 GiB
            c = ContainerSample(container="idle", cpu_cores=0.1, mem_bytes=200.0 * MIB, cpu_limit_cores=4.0,
                                mem_limit_bytes=float(2**31), nr_periods=10)
            p.produce(SAMPLES.name, key=host.encode(),
                      value=encode(HostSamples(host=host, ts=t0 + 0.5 * i, interval_s=0.5, containers=(c,))))
        p.flush(10)
        got: list[Decision] = []
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not any(d.cpu_limit_cores for d in got):
            m = consumer.poll(0.5)
            if m is not None and not m.error():
                try:
                    d = decode(Decision, m.value())
                except SchemaError:  # other tests' hostile records share the topic
                    continue
                if d.host == host:
                    got.append(d)
        cuts = [d for d in got if d.cpu_limit_cores is not None]
        assert cuts, worker.log_tail()
        d = cuts[0]
        assert d.policy == policy and d.ts - t0 >= 8.0  # not before the minimum history
        assert d.cpu_limit_cores == pytest.approx(3.0)  # 4 cores cut by at most 25 %
        assert "step" in d.details["safety"]["bounded_by"]["cpu"] and "cpu by step" in d.reason
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = scrape(f"http://127.0.0.1:{port}/metrics")
            if m.get('phasewise_worker_safety_bounded_total{rule="step"}', 0) >= 1:
                break
            time.sleep(0.3)
        assert m['phasewise_worker_safety_bounded_total{rule="step"}'] >= 1
        assert m['phasewise_worker_safety_bounded_total{rule="history"}'] >= 1
    finally:
        consumer.close()
        worker.stop()
