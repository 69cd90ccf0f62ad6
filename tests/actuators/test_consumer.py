"""The decision consumer: handle() without Kafka, then the loop against the real broker."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import CgroupBackend, DryRunBackend
from phasewise.actuators.commands import Outcome, SetLimits
from phasewise.actuators.consumer import group_id, run_actuator
from phasewise.actuators.ledger import Ledger, ledger_path
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.kafka.partitions import PARTITIONER
from phasewise.kit.records import Actuation, DeadLetter, Decision, decode, encode
from phasewise.kit.settings import Settings
from phasewise.kit.topics import ACTUATIONS, DEAD_LETTERS, DECISIONS
from tests.conftest import requires_root

MiB = 2**20
NOW = time.time()  # the actuators' clock in handle() tests (the ledger prunes against real time); the loop
# tests run on the real clock and stamp their decisions when they send them (a module may run minutes after
# it was imported)


def mk_settings(**kw) -> Settings:
    return Settings().replace(**{"host": "h1", "apply_retries": 2, "apply_retry_backoff_s": 0.1,
                                 **kw})


def decision_bytes(host: str = "h1", **kw) -> bytes:
    fields = dict(id=uuid.uuid4().hex, ts=NOW - 1.0, host=host, container="job-a", action="limit",
                  policy="test", cpu_limit_cores=1.0)
    return encode(Decision(**{**fields, **kw}))


def make(recorder, backend=None, ledger=None, settings=None, sleeps=None):
    metrics = ActuatorMetrics(CollectorRegistry())
    ledger = Ledger(":memory:") if ledger is None else ledger
    a = Actuator(settings or mk_settings(), backend or DryRunBackend(), ledger, recorder,
                 metrics=metrics, host_cores=4.0, clock=lambda: NOW,
                 sleep=(sleeps.append if sleeps is not None else lambda s: None))
    return a, metrics


def count(metrics: ActuatorMetrics, status: str) -> float:
    return metrics.registry.get_sample_value("phasewise_actuator_decisions_total", {"status": status})


# --------------------------------------------------------------------------- handle(), no broker


def test_the_same_decision_twice_is_applied_once_and_then_reported_duplicate(recorder):
    backend = DryRunBackend()
    a, metrics = make(recorder, backend)
    raw = decision_bytes()
    first = a.handle(raw, b"h1", 3, 10)
    second = a.handle(raw, b"h1", 3, 10)
    assert first.status == "applied" and second.status == "duplicate"
    assert "already handled" in second.message and "applied" in second.message
    assert backend.commands == [SetLimits("job-a", cpu_cores=1.0)]
    assert recorder.actuations() == [first, second]
    assert count(metrics, "applied") == 1 and count(metrics, "duplicate") == 1


def test_memory_stays_above_the_peak_the_decision_declares_and_the_peaks_the_actuator_read(recorder):
    usage = {"job-a": 300 * MiB}
    backend = DryRunBackend(usage=usage.get)
    a, _ = make(recorder, backend, settings=mk_settings(mem_margin_bytes=64 * MiB, mem_floor_bytes=0))
    declared = a.handle(decision_bytes(mem_limit_bytes=200 * MiB, cpu_limit_cores=None,
                                       details={"safety": {"peak_mem_bytes": 800 * MiB}}), None, 0, 0)
    assert declared.status == "clamped" and declared.mem_limit_bytes == 864 * MiB
    assert "recent peak 800.0 MiB" in declared.message
    usage["job-a"] = 100 * MiB  # the working set fell; the actuator remembers the 300 MiB it read
    own = a.handle(decision_bytes(mem_limit_bytes=150 * MiB, cpu_limit_cores=None), None, 0, 1)
    assert own.status == "clamped" and own.mem_limit_bytes == 364 * MiB


def test_a_restarted_actuator_does_not_apply_a_redelivered_decision(recorder, tmp_path):
    path = ledger_path(tmp_path, "h1")
    raw = decision_bytes()
    b1, b2 = DryRunBackend(), DryRunBackend()
    with Ledger(path) as led:
        assert make(recorder, b1, led)[0].handle(raw, None, 0, 0).status == "applied"
    with Ledger(path) as led:  # the process restarted; Kafka redelivers the uncommitted message
        assert make(recorder, b2, led)[0].handle(raw, None, 0, 0).status == "duplicate"
    assert len(b1.commands) == 1 and b2.commands == []


def test_an_actuation_carries_the_decision_time_host_and_applied_values(recorder):
    a, _ = make(recorder, DryRunBackend(usage=lambda c: 100 * MiB))
    act = a.handle(decision_bytes(cpu_limit_cores=0.01, mem_limit_bytes=10 * MiB), b"h1", 0, 5)
    assert act.status == "clamped"
    assert (act.decision_ts, act.ts, act.host, act.backend) == (NOW - 1.0, NOW, "h1", "dry-run")
    assert act.cpu_limit_cores == 0.05 and act.mem_limit_bytes == 164 * MiB
    assert "CPU floor" in act.message and "current usage" in act.message
    topic, key, _ = recorder.sent[-1]
    assert (topic, key) == (ACTUATIONS.name, b"h1")


def test_a_malformed_decision_is_dead_lettered_with_its_reason_and_position(recorder):
    a, metrics = make(recorder)
    assert a.handle(b'{"v": 1, "id": "x"', b"h1", 2, 42) is None
    assert a.handle(b'{"v": 1, "id": "x", "host": "h1"}', b"h1", 2, 43) is None
    dl = recorder.dead_letters()
    assert [d.offset for d in dl] == [42, 43] and all(d.partition == 2 for d in dl)
    assert "not valid JSON" in dl[0].reason
    assert dl[1].reason == "Decision: missing field 'ts'"
    assert dl[1].payload == '{"v": 1, "id": "x", "host": "h1"}' and dl[1].source_topic == DECISIONS.name
    assert recorder.actuations() == []
    assert metrics.registry.get_sample_value("phasewise_actuator_dead_letters_total") == 2


def test_a_decision_for_another_host_is_ignored(recorder):
    backend = DryRunBackend()
    a, metrics = make(recorder, backend)
    raw = decision_bytes(host="h2")
    assert a.handle(raw, b"h2", 0, 0) is None
    assert recorder.sent == [] and backend.commands == [] and len(a.ledger) == 0
    assert metrics.registry.get_sample_value("phasewise_actuator_ignored_total") == 1


class Flaky:
    """A backend whose writes fail temporarily *n* times, then succeed (or fail for good)."""

    name = "flaky"

    def __init__(self, n: int, *, temporary: bool = True) -> None:
        self.n, self.temporary, self.calls = n, temporary, 0

    def exists(self, c):
        return True

    def memory_usage(self, c):
        return 0.0

    def apply(self, command):
        self.calls += 1
        if self.calls <= self.n:
            return Outcome.failed("device busy", temporary=self.temporary)
        return Outcome.applied("ok", cpu_cores=command.cpu_cores)


def test_temporary_backend_errors_are_retried_with_doubling_backoff(recorder):
    sleeps: list[float] = []
    backend = Flaky(2)
    a, metrics = make(recorder, backend, sleeps=sleeps)
    act = a.handle(decision_bytes(), None, 0, 0)
    assert act.status == "applied" and backend.calls == 3
    assert sleeps == [0.1, 0.2]
    assert metrics.registry.get_sample_value("phasewise_actuator_retries_total") == 2


def test_temporary_errors_give_up_after_the_retries_and_report_failed(recorder):
    sleeps: list[float] = []
    backend = Flaky(10)
    act = make(recorder, backend, sleeps=sleeps)[0].handle(decision_bytes(), None, 0, 0)
    assert act.status == "failed" and backend.calls == 3 and "gave up after 3 attempts" in act.message


def test_permanent_backend_errors_are_not_retried(recorder):
    backend = Flaky(10, temporary=False)
    a, metrics = make(recorder, backend)
    act = a.handle(decision_bytes(), None, 0, 0)
    assert act.status == "failed" and backend.calls == 1 and act.message == "device busy"
    assert a.ledger.get(act.decision_id).status == "failed"
    assert count(metrics, "failed") == 1


def test_sizes_accept_binary_and_decimal_units():
    from phasewise.kit.settings import parse_size

    assert parse_size("67108864") == 64 * MiB
    assert parse_size("64Mi") == 64 * MiB
    assert parse_size("1G") == 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


# --------------------------------------------------------------------------- the loop, real broker


def run_in_thread(settings: Settings, backend, registry: CollectorRegistry, ledger: Ledger):
    stop = threading.Event()
    errors: list[BaseException] = []

    def target():
        try:
            run_actuator(settings, backend, stop, metrics=ActuatorMetrics(registry), ledger=ledger,
                         host_cores=4.0)
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return stop, t, errors


def collect(settings: Settings, want, timeout_s: float = 40.0) -> tuple[list[Actuation], list[DeadLetter]]:
    """Read actuations and dead letters of this test's host until *want* holds."""
    from phasewise.kit.kafka.client import make_consumer

    c = make_consumer(settings, f"test-{uuid.uuid4().hex[:6]}")
    c.subscribe([ACTUATIONS.name, DEAD_LETTERS.name])
    acts: list[Actuation] = []
    dls: list[DeadLetter] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not want(acts, dls):
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            if m.topic() == ACTUATIONS.name:
                a = decode(Actuation, m.value())
                if a.host == settings.host:
                    acts.append(a)
            else:
                d = decode(DeadLetter, m.value())
                if d.key == settings.host:
                    dls.append(d)
    finally:
        c.close()
    return acts, dls


@pytest.mark.broker
def test_the_loop_publishes_actuations_and_dead_letters_and_skips_other_hosts(settings):
    from phasewise.kit.kafka.client import make_producer

    host = settings.host
    key = host.encode()
    other = decision_bytes(ts=time.time() - 1.0, host=f"other-{host}")
    mine = decision_bytes(ts=time.time() - 1.0, host=host, mem_limit_bytes=None)
    malformed = b'{"v": 1, "id": "broken", "host": "' + key + b'"}'
    p = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
    # the other host's decision is (mis)keyed with this host, so it shares the partition and is
    # consumed before ours: once ours is reported, it has certainly been seen and skipped
    for value in (other, malformed, mine, mine):
        p.produce(DECISIONS.name, key=key, value=value)
    assert p.flush(10) == 0

    registry = CollectorRegistry()
    backend = DryRunBackend()
    ledger = Ledger(":memory:")
    stop, thread, errors = run_in_thread(settings, backend, registry, ledger)
    try:
        acts, dls = collect(settings, lambda a, d: len(a) >= 2 and len(d) >= 1)
    finally:
        stop.set()
        thread.join(20)
    assert not errors, errors
    assert not thread.is_alive()
    mine_id = decode(Decision, mine).id
    assert [(a.decision_id, a.status) for a in acts] == [(mine_id, "applied"), (mine_id, "duplicate")]
    assert acts[0].decision_ts == decode(Decision, mine).ts and acts[0].backend == "dry-run"
    assert backend.commands == [SetLimits("job-a", cpu_cores=1.0)]
    assert decode(Decision, other).id not in ledger
    assert registry.get_sample_value("phasewise_actuator_ignored_total") >= 1
    [dl] = dls
    assert dl.reason == "Decision: missing field 'ts'" and dl.source_topic == DECISIONS.name
    assert dl.payload == malformed.decode() and dl.offset is not None


@pytest.mark.broker
def test_a_restarted_loop_resumes_after_its_committed_offset(settings, tmp_path):
    from phasewise.kit.kafka.client import make_producer

    p = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
    first = decision_bytes(ts=time.time() - 1.0, host=settings.host)
    p.produce(DECISIONS.name, key=settings.host.encode(), value=first)
    assert p.flush(10) == 0
    backend = DryRunBackend()
    path = ledger_path(settings.data_dir, settings.host)

    def once(want):
        with Ledger(path) as led:
            stop, thread, errors = run_in_thread(settings, backend, CollectorRegistry(), led)
            try:
                got = collect(settings, want)[0]
            finally:
                stop.set()
                thread.join(20)
        assert not errors, errors
        return got

    assert [a.status for a in once(lambda a, d: len(a) >= 1)] == ["applied"]
    second = decision_bytes(ts=time.time() - 1.0, host=settings.host, cpu_limit_cores=2.0)
    p.produce(DECISIONS.name, key=settings.host.encode(), value=second)
    assert p.flush(10) == 0
    acts = once(lambda a, d: len(a) >= 2)
    # the first decision was committed: not seen again, not even as a duplicate
    assert [(a.decision_id, a.status) for a in acts] == [
        (decode(Decision, first).id, "applied"), (decode(Decision, second).id, "applied")]
    assert [c.cpu_cores for c in backend.commands] == [1.0, 2.0]


@requires_root
@pytest.mark.broker
def test_the_loop_applies_a_decision_to_a_real_cgroup(settings):
    import subprocess
    import sys

    from phasewise.kit.cgroups.fs import CgroupLayout

    layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
    layout.create("job-a")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    layout.attach("job-a", proc.pid)
    try:
        from phasewise.kit.kafka.client import make_producer

        p = make_producer(settings, partitioner=PARTITIONER)  # as the worker: the host's partition
        raw = decision_bytes(ts=time.time() - 1.0, host=settings.host, cpu_limit_cores=0.3, mem_limit_bytes=256 * MiB)
        p.produce(DECISIONS.name, key=settings.host.encode(), value=raw)
        assert p.flush(10) == 0
        stop, thread, errors = run_in_thread(settings, CgroupBackend(layout), CollectorRegistry(),
                                             Ledger(":memory:"))
        try:
            acts, _ = collect(settings, lambda a, d: len(a) >= 1)
        finally:
            stop.set()
            thread.join(20)
        assert not errors, errors
        [act] = acts
        assert act.status == "applied" and act.backend == "cgroup-v1", act
        assert (layout.path("job-a", "cpu") / "cpu.cfs_quota_us").read_text().strip() == "30000"
        assert int((layout.path("job-a", "memory") / "memory.limit_in_bytes").read_text()) == 256 * MiB
    finally:
        proc.kill()
        proc.wait()
        layout.remove("job-a")
        for c in layout.controllers():
            try:
                layout.base(c).rmdir()
            except OSError:
                pass


def test_each_host_has_its_own_consumer_group():
    assert group_id("node-7") == "phasewise-actuator-node-7"


def test_a_backend_that_raises_still_yields_a_failed_report_and_a_ledger_entry(recorder):
    class Broken(Flaky):
        def exists(self, c):
            raise RuntimeError("inventory unreachable")

    a, _ = make(recorder, Broken(0))
    act = a.handle(decision_bytes(), None, 0, 0)
    assert act.status == "failed" and "inventory unreachable" in act.message
    assert a.ledger.get(act.decision_id).status == "failed"


def test_a_stop_ends_the_wait_for_undelivered_actuations_without_committing():
    """The broker gone: a batch's actuations never deliver. A stop asked for meanwhile ends the wait at once
    (the role stops within its 5 s), and the batch's offsets stay uncommitted (redelivered, then duplicates)."""
    from phasewise.actuators.consumer import COMMIT_FLUSH_S, _commit_handled

    stop = threading.Event()

    class Stuck:
        slices: list[float] = []

        def flush(self, timeout: float) -> int:
            self.slices.append(timeout)
            if len(self.slices) == 2:  # a stop asked for while the second slice waits
                stop.set()
            return 1

    class Consumer:
        committed: list = []

        def commit(self, **kwargs) -> None:
            self.committed.append(kwargs)

    c, producer = Consumer(), Stuck()
    _commit_handled(c, producer, {("phasewise.decisions.v1", 0): 5}, stop)
    assert len(producer.slices) == 2 and all(0 < s <= 0.5 < COMMIT_FLUSH_S for s in producer.slices)
    assert c.committed == []
