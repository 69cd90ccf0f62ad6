"""Every role's /metrics, /healthz and /readyz server, and the metrics the roles add for operators."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from phasewise import __version__
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.kafka.client import lag_by_topic
from phasewise.kit.observe import Health, serve
from phasewise.kit.topics import DECISIONS
from phasewise.producers.metrics import ProducerMetrics
from phasewise.streams.metrics import OUTPUT_TOPICS, WorkerMetrics


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_health_is_live_while_loops_beat_and_ready_when_the_role_says_so():
    now = [0.0]
    why = ["no partitions yet"]
    h = Health(ready=lambda: why[0], clock=lambda: now[0])
    assert h.live() is None  # no loop yet
    h.beat("consume", 30)
    now[0] = 20
    assert h.live() is None and h.ready() == "no partitions yet"
    why[0] = None
    assert h.ready() is None
    now[0] = 31
    assert h.live() == "consume loop silent for 31 s" and h.ready() == h.live()
    h2 = Health(ready=lambda: 1 / 0)
    assert h2.ready() == "readiness check failed: ZeroDivisionError: division by zero"


def test_the_server_answers_metrics_health_and_readiness_on_the_bound_address():
    reg = CollectorRegistry()
    ActuatorMetrics(reg)
    now = [0.0]
    ready = ["waiting for the broker at k:9092"]
    h = Health(ready=lambda: ready[0], clock=lambda: now[0])
    h.beat("consume", 30)
    srv = serve(reg, 0, h, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{srv.port}"
        assert srv.address == "127.0.0.1"
        status, text = get(base + "/metrics")
        assert status == 200
        assert 'phasewise_build_info{python="' in text and f'version="{__version__}"' in text
        assert 'role="actuator"' in text
        # ?name[]=: only those samples (what a bench polling one counter asks for)
        status, only = get(base + "/metrics?name[]=phasewise_actuator_decisions_total&name[]=nope")
        samples = [x for x in only.splitlines() if x and not x.startswith("#")]
        assert status == 200 and samples and all(x.startswith("phasewise_actuator_decisions_total") for x in samples)
        assert get(base + "/healthz") == (200, "ok\n")
        assert get(base + "/readyz") == (503, "waiting for the broker at k:9092\n")
        ready[0] = None
        assert get(base + "/readyz") == (200, "ok\n")
        now[0] = 100
        assert get(base + "/healthz") == (503, "consume loop silent for 100 s\n")
        assert get(base + "/nope")[0] == 404
    finally:
        srv.close()


def test_every_role_exports_build_info_and_the_worker_presets_its_labelled_series():
    from phasewise.streams.metrics import HorusMetrics, PlacementMetrics

    for cls, role in ((ProducerMetrics, "producer"), (WorkerMetrics, "worker"), (ActuatorMetrics, "actuator"),
                      (HorusMetrics, "horus"), (PlacementMetrics, "place")):
        reg = CollectorRegistry()
        cls(reg)
        got = [s for f in reg.collect() if f.name == "phasewise_build_info" for s in f.samples]
        assert len(got) == 1 and got[0].labels["role"] == role and got[0].value == 1
    reg = CollectorRegistry()
    WorkerMetrics(reg)
    for t in OUTPUT_TOPICS:  # zero before the first error: increase() sees a first error
        assert reg.get_sample_value("phasewise_worker_delivery_errors_total", {"topic": t}) == 0
    for pol in ("vpa", "phase", "other"):
        assert reg.get_sample_value("phasewise_worker_recommendations_total", {"policy": pol}) == 0


def test_decisions_are_counted_by_bounded_policy_with_their_sample_to_decision_time():
    reg = CollectorRegistry()
    m = WorkerMetrics(reg)
    ds = [SimpleNamespace(policy="vpa", ts=100.0), SimpleNamespace(policy="phase", ts=99.0),
          SimpleNamespace(policy="someone-elses-" + "x" * 50, ts=110.0)]
    m.decided(ds, now=101.0)
    v = lambda name, pol: reg.get_sample_value(name, {"policy": pol})  # noqa: E731
    assert v("phasewise_worker_recommendations_total", "vpa") == 1
    assert v("phasewise_worker_recommendations_total", "phase") == 1
    assert v("phasewise_worker_recommendations_total", "other") == 1  # never the foreign label itself
    assert v("phasewise_worker_sample_to_decision_seconds_sum", "phase") == 2.0
    assert v("phasewise_worker_sample_to_decision_seconds_sum", "other") == 0.0  # clock skew: not negative
    labels = {s.labels.get("policy") for f in reg.collect() for s in f.samples if "policy" in s.labels}
    assert labels == {"vpa", "phase", "other"}
    m.decided([SimpleNamespace(policy="vpa", ts=100.5, details={"prior": {}}),
               SimpleNamespace(policy="vpa", ts=100.5, details={"rule": "x"})], now=101.0)
    assert v("phasewise_worker_recommendations_total", "vpa") == 3
    assert v("phasewise_worker_sample_to_decision_seconds_count", "vpa") == 3
    assert reg.get_sample_value("phasewise_worker_prior_decisions_total") == 1


def test_consumer_lag_per_topic_from_librdkafka_statistics():
    doc = {"topics": {DECISIONS.name: {"partitions": {"0": {"consumer_lag": 5}, "1": {"consumer_lag": 7},
                                                      "-1": {"consumer_lag": -1}}},
                      "other": {"partitions": {"0": {"consumer_lag": -1}}}}}
    assert lag_by_topic(json.dumps(doc)) == {DECISIONS.name: 12}
    from phasewise.actuators.consumer import lag_statistics

    reg = CollectorRegistry()
    m = ActuatorMetrics(reg)
    opts = lag_statistics(m)
    assert opts["statistics.interval.ms"] == 5000
    opts["stats_cb"](json.dumps(doc))
    assert reg.get_sample_value("phasewise_actuator_consumer_lag", {"topic": DECISIONS.name}) == 12
    opts["stats_cb"]("not json")  # a bad document changes nothing
    assert reg.get_sample_value("phasewise_actuator_consumer_lag", {"topic": DECISIONS.name}) == 12


def test_the_actuator_times_decision_to_actuation_from_the_record_time(tmp_path):
    from phasewise.actuators.backends import DryRunBackend
    from phasewise.actuators.consumer import Actuator
    from phasewise.actuators.ledger import Ledger
    from phasewise.kit.records import Decision, encode
    from phasewise.kit.settings import Settings

    class Sink:
        def produce(self, *a, **k):
            pass

        def poll(self, t=0):
            return 0

    reg = CollectorRegistry()
    s = Settings(host="h")
    a = Actuator(s, DryRunBackend(), Ledger(tmp_path / "l.sqlite"), Sink(), metrics=ActuatorMetrics(reg),
                 clock=lambda: 1000.0)
    d = Decision(id="d1", ts=999.5, host="h", container="job", action="limit", policy="vpa", cpu_limit_cores=1.0)
    a.handle(encode(d), b"h", 0, 0, produced_at=999.75)
    assert reg.get_sample_value("phasewise_actuator_decision_to_actuation_seconds_sum") == 0.25
    assert reg.get_sample_value("phasewise_actuator_decision_to_actuation_seconds_count") == 1


def test_a_job_worker_is_live_while_its_loop_beats_and_ready_with_its_own_gauge():
    """phasewise horus / place: streams.worker.watch on the role's ready gauge, served by phasewise.kit.observe."""
    from phasewise.streams.metrics import HorusMetrics
    from phasewise.streams.worker import watch

    class Signal:
        def __init__(self) -> None:
            self.receivers = []

        def connect(self, fn):
            self.receivers.append(fn)
            return fn

    class App:  # what watch() needs of a Faust app: timers (not run here), the revocation signal
        def __init__(self) -> None:
            self.timers = []
            self.on_partitions_revoked = Signal()

        def timer(self, every):
            def add(fn):
                self.timers.append((every, fn))
                return fn
            return add

    class Probe:  # phasewise.kit.kafka.client.BrokerProbe's answer
        why: str | None = None

        def outage(self):
            return self.why

    m = HorusMetrics(CollectorRegistry())
    app = App()
    probe = Probe()
    health = watch(app, m, ready="phasewise_horus_ready", probe=probe)
    assert [every for every, _ in app.timers] == [1.0]  # the heartbeat; no consumer lag metric to keep
    srv = serve(m.registry, 0, health, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{srv.port}"
        assert get(base + "/healthz") == (200, "ok\n")
        assert get(base + "/readyz") == (503, "no partitions assigned yet (joining the consumer group) "
                                              "(or an agent died)\n")
        m.ready.set(1)
        assert get(base + "/readyz") == (200, "ok\n")
        probe.why = "no Kafka broker answers at k:9092 (Connection refused)"
        assert get(base + "/readyz") == (503, probe.why + "\n")
        probe.why = None
        [revoked] = app.on_partitions_revoked.receivers
        asyncio.run(revoked(app, revoked=set()))  # a rebalance begins: not ready until it completes
        assert get(base + "/readyz")[0] == 503
        assert 'role="horus"' in get(base + "/metrics")[1]
    finally:
        srv.close()
