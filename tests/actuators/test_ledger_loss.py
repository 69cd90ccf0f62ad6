"""A deleted ledger between two runs of the real actuator loop (embedded broker, dry-run backend).

The decisions of the first run come again (as after a worker restart, which
republishes decisions with their ids). With the check, they are reported as
duplicates and none is applied twice; the control shows that the same steps
without the check apply them again.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.backends import DryRunBackend
from phasewise.actuators.commands import SetLimits
from phasewise.actuators.consumer import run_actuator
from phasewise.actuators.ledger import Ledger, ledger_path
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.kafka.client import make_producer
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.records import Decision, encode
from phasewise.kit.topics import DECISIONS
from tests.actuators.test_consumer import collect

pytestmark = pytest.mark.broker


def decision(host: str, cores: float) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host=host, container="job-a", action="limit",
                           policy="test", cpu_limit_cores=cores))


def publish(settings, *values: bytes) -> None:
    p = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
    for v in values:
        p.produce(DECISIONS.name, key=settings.host.encode(), value=v)
    assert p.flush(10) == 0


def run_until(settings, backend, want, *, ledger: Ledger | None = None):
    """The actuator loop (its own ledger under data_dir unless *ledger*) until *want* holds on its actuations."""
    registry = CollectorRegistry()
    stop = threading.Event()
    errors: list[BaseException] = []

    def target():
        try:
            run_actuator(settings, backend, stop, metrics=ActuatorMetrics(registry), ledger=ledger, host_cores=4.0)
        except BaseException as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    try:
        acts = collect(settings, lambda a, d: want(a), timeout_s=60)[0]
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert not t.is_alive()
    return acts, registry


def delete_ledger(settings) -> None:
    path = ledger_path(settings.data_dir, settings.host)
    gone = [p for p in path.parent.glob(path.name + "*")]
    assert gone, "no ledger to delete"
    for p in gone:
        p.unlink()


def first_run(settings, backend):
    d1, d2 = decision(settings.host, 1.0), decision(settings.host, 2.0)
    publish(settings, d1, d2)
    acts, registry = run_until(settings, backend, lambda a: len(a) >= 2)
    assert [a.status for a in acts] == ["applied", "applied"]
    # a first start: the new ledger had no predecessor, nothing was lost or restored
    assert registry.get_sample_value("phasewise_actuator_ledger_lost_timestamp_seconds") == 0
    assert registry.get_sample_value("phasewise_actuator_ledger_restored_total") == 0
    return d1, d2, [a.decision_id for a in acts]


def test_a_deleted_ledger_is_restored_from_the_actuations_and_no_decision_is_applied_twice(settings, caplog):
    backend = DryRunBackend()
    d1, d2, ids = first_run(settings, backend)
    delete_ledger(settings)
    d3 = decision(settings.host, 3.0)
    publish(settings, d1, d2, d3)  # the first two again, as a restarted worker republishes them
    t0 = time.time()
    acts, registry = run_until(settings, backend, lambda a: len(a) >= 5)
    second = [(a.decision_id, a.status) for a in acts[2:]]
    assert second[:2] == [(ids[0], "duplicate"), (ids[1], "duplicate")], second
    assert second[2][1] == "applied"
    assert backend.commands == [SetLimits("job-a", cpu_cores=c) for c in (1.0, 2.0, 3.0)]
    assert registry.get_sample_value("phasewise_actuator_ledger_lost_timestamp_seconds") >= t0
    assert registry.get_sample_value("phasewise_actuator_ledger_restored_total") == 2
    assert any("LEDGER LOST" in r.getMessage() for r in caplog.records)
    with Ledger(ledger_path(settings.data_dir, settings.host)) as led:
        assert not led.unverified  # checked and restored: the next start is an ordinary one
        assert "restored from its actuation of" in led.get(ids[0]).message


def test_control_without_the_check_a_deleted_ledger_applies_the_decisions_again(settings):
    backend = DryRunBackend()
    d1, d2, ids = first_run(settings, backend)
    delete_ledger(settings)
    publish(settings, d1, d2)
    with Ledger(ledger_path(settings.data_dir, settings.host)) as led:
        led.verified()  # what the actuator did before: take the empty ledger as it is
        acts, _ = run_until(settings, backend, lambda a: len(a) >= 4, ledger=led)
    assert [(a.decision_id, a.status) for a in acts[2:]] == [(ids[0], "applied"), (ids[1], "applied")]
    assert len(backend.commands) == 4  # each applied twice
