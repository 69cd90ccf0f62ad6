"""``phasewise worker --policy phase`` for real: snapshots, phase changes and a restart, on the module's broker."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from phasewise.apps.bench.harness import scrape
from phasewise.kit.broker import free_port
from phasewise.kit.kafka.client import make_consumer, make_producer
from phasewise.kit.procs import RoleProcess
from phasewise.kit.records import (
    Decision,
    ModelSnapshot,
    PhaseChange,
    SchemaError,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.topics import DECISIONS, MODELS, PHASES, SAMPLES
from phasewise.models.phases.snapshots import model_name, model_of
from tests.models.phases.test_phase_updater import msg, regime

NAME = model_name()


# ---------------------------------------------------------------------------------------- a real worker
class Worker:
    def __init__(self, settings: Settings, tmp, worker_id: str) -> None:
        self.metrics_port = free_port()
        self.tmp = tmp
        # the phase pipeline's own decisions: tests/streams/test_safety_rules.py runs one with the rules on
        env = {"PHASEWISE_BOOTSTRAP": settings.kafka.bootstrap, "PHASEWISE_VPA_TIME_SCALE": "0.001",
               "PHASEWISE_LOG_LEVEL": "info", "PHASEWISE_SAFETY_RULES": "false"}
        self.args = ["--policy", "phase", "--snapshot-interval", "1", "--learn-every", "1", "--phase-warmup", "32",
                     "--recommend-interval", "1", "--web-port", "0", "--worker-id", worker_id,
                     "--data-dir", str(tmp / "data"), "--metrics-port", str(self.metrics_port)]
        self.env = env
        self.role: RoleProcess | None = None

    def start(self, timeout_s: float = 150.0) -> Worker:
        self.role = RoleProcess("worker", self.args, env=self.env,
                                log_path=self.tmp / f"worker-{uuid.uuid4().hex[:4]}.log").start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.role.alive(), "worker exited:\n" + self.role.log_tail()
            try:
                if self.metric("phasewise_worker_ready") == 1.0:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("worker not ready:\n" + self.role.log_tail())

    def metric(self, name: str) -> float:
        # (a generous timeout: a loaded machine can hold the worker's metrics thread for seconds)
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout_s=30.0).get(name, 0.0)

    def log(self) -> str:
        assert self.role is not None
        return self.role.log_path.read_text(errors="replace")


def read_until(settings: Settings, topic: str, partitions: int, pred, timeout_s: float, what: str) -> list:
    c = make_consumer(settings, f"pwtest-{uuid.uuid4().hex[:6]}")
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    hits: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error():
                if hits:
                    return hits
                continue
            v = pred(m)
            if v is not None:
                hits.append(v)
        if hits:
            return hits
        raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
    finally:
        c.close()


def _snapshot(m):
    try:
        s = decode(ModelSnapshot, m.value())
    except SchemaError:
        return None
    return s if s.name == NAME else None


@pytest.mark.broker
@pytest.mark.slow
def test_a_phase_worker_publishes_snapshots_and_phase_changes_and_a_restart_resumes_from_the_snapshot(
        settings, tmp_path):
    w = Worker(settings, tmp_path, f"pwtest-phase-{uuid.uuid4().hex[:6]}").start()
    host = f"ph-{uuid.uuid4().hex[:6]}"
    p = make_producer(settings)
    t0 = time.time() - 3600

    def send(lo: int, hi: int) -> None:
        for t in range(lo, hi):
            p.produce(SAMPLES.name, key=host.encode(), value=encode(msg(host, t0 + t, {"job": regime(t)})))
        p.flush(10)

    try:
        send(0, 120)  # the learner warms the shared model up on the detectors' windows
        deadline = time.monotonic() + 90
        warm = None
        while warm is None and time.monotonic() < deadline:
            try:
                snaps = read_until(settings, MODELS.name, 1, _snapshot, 5, "model snapshot")
            except TimeoutError:  # none yet: read again from the start
                continue
            warm = next((s for s in reversed(snaps) if model_of(s).ready), None)
        assert warm is not None, "no warm snapshot:\n" + w.role.log_tail()
        deadline = time.monotonic() + 60
        while w.metric("phasewise_worker_model_version") < warm.version and time.monotonic() < deadline:
            time.sleep(0.2)
        send(120, 240)  # now the detector knows the phases: the regime switches are phase changes

        def change(m):
            try:
                c = decode(PhaseChange, m.value())
            except SchemaError:
                return None
            return c if c.host == host and c.container == "job" else None

        changes = read_until(settings, PHASES.name, PHASES.partitions, change, 30, "phase change")
        assert any(c.old_phase is not None and c.new_phase != c.old_phase for c in changes), changes

        def decision(m):
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                return None
            return d if d.host == host else None

        ds = read_until(settings, DECISIONS.name, DECISIONS.partitions, decision, 20, "decision")
        assert ds and all(d.policy == "phase" for d in ds)
        assert {d.details["source"] for d in ds} <= {"phase", "fallback:vpa", "mixed"}
        assert w.metric("phasewise_worker_snapshots_published_total") >= 1
        assert w.metric("phasewise_worker_phase_changes_total") >= 2
        version = w.metric("phasewise_worker_model_version")
        assert w.role.stop() == 0

        w.start()  # a restart resumes from the newest snapshot on the compacted topic
        assert w.metric("phasewise_worker_model_version") >= version
        assert "phase detector starts from snapshot v" in w.log()
    finally:
        if w.role is not None:
            w.role.stop()


@pytest.mark.broker
@pytest.mark.slow
def test_a_vpa_worker_with_phase_workloads_decides_each_container_with_its_workloads_policy(settings, tmp_path):
    """``--policy vpa --phase-workloads``: the VPA stays the default, and a workload annotated
    ``phasewise.io/policy: phase`` is decided by the phase machinery the worker now runs."""
    from phasewise.kit.records import WorkloadPolicy

    w = Worker(settings, tmp_path, f"pwtest-mixed-{uuid.uuid4().hex[:6]}")
    w.args = ["--policy", "vpa", "--phase-workloads", *w.args[2:]]
    w.start()
    host = f"mx-{uuid.uuid4().hex[:6]}"
    wants = WorkloadPolicy(mode="apply", source="annotation", policy="phase")
    p = make_producer(settings)
    t0 = time.time() - 3600
    try:
        for t in range(60):
            m = msg(host, t0 + t, {"plain": regime(t), "wants-phase": regime(t)})
            m = dataclasses.replace(m, containers=tuple(
                c if c.container == "plain" else dataclasses.replace(c, workload=wants) for c in m.containers))
            p.produce(SAMPLES.name, key=host.encode(), value=encode(m))
        p.flush(10)
        got: dict[str, set[str]] = {}

        def decision(m):
            try:
                d = decode(Decision, m.value())
            except SchemaError:
                return None
            if d.host == host:
                got.setdefault(d.container, set()).add(d.policy)
            return d if d.host == host else None

        deadline = time.monotonic() + 90  # each pass reads the topic from its start; none may hold ours yet
        while set(got) != {"plain", "wants-phase"} and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                read_until(settings, DECISIONS.name, DECISIONS.partitions, decision, 5, "decision")
        assert got == {"plain": {"vpa"}, "wants-phase": {"phase"}}, (got, w.role.log_tail())
        assert w.metric('phasewise_worker_policy_refused_total{policy="phase"}') == 0
    finally:
        if w.role is not None:
            w.role.stop()
