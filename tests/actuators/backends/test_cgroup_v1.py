"""The cgroup backend against the host's real cgroup v1 hierarchies (needs root)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from phasewise.actuators.actuator import Actuator
from phasewise.actuators.backends import CgroupBackend
from phasewise.actuators.commands import Freeze, SetLimits, Thaw
from phasewise.actuators.ledger import Ledger
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.cgroups.fs import CgroupLayout
from phasewise.kit.records import Decision, encode
from phasewise.kit.settings import Settings
from tests.conftest import requires_root

pytestmark = requires_root

MiB = 2**20
# waits for a line on stdin (so it can be moved into the cgroup first), allocates
# and touches the requested MiB, says "ready", then burns or sleeps
CHILD = """
import sys, time
sys.stdin.readline()
block = b"x" * (int(sys.argv[1]) * 2**20)
print("ready", flush=True)
if sys.argv[2] == "burn":
    while True:
        pass
time.sleep(600)
"""


class Managed:
    """A unique managed prefix with one container and a process in it."""

    def __init__(self) -> None:
        self.layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}", version=1)
        self.procs: list[subprocess.Popen] = []

    def container(self, name: str, *, alloc_mib: int = 0, mode: str = "sleep") -> subprocess.Popen:
        self.layout.create(name)
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(alloc_mib), mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        self.layout.attach(name, p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ready"
        return p

    def file(self, name: str, controller: str, fname: str) -> Path:
        return self.layout.path(name, controller) / fname

    def close(self) -> None:
        for p in self.procs:
            try:  # a frozen process cannot die until thawed
                for c in self.layout.containers():
                    (self.layout.path(c, "freezer") / "freezer.state").write_text("THAWED")
            except OSError:
                pass
            p.kill()
            p.wait()
        for c in self.layout.containers():
            self.layout.remove(c)
        for c in self.layout.controllers():
            try:
                self.layout.base(c).rmdir()
            except OSError:
                pass


@pytest.fixture
def managed():
    m = Managed()
    try:
        yield m
    finally:
        m.close()


def settings(**kw) -> Settings:
    return Settings().replace(**{"host": "h1", "cpu_floor_cores": 0.05,
                                 "mem_margin_bytes": 64 * MiB, "mem_floor_bytes": 16 * MiB,
                                 "apply_retries": 0, **kw})


def decision(container: str, **kw) -> bytes:
    return encode(Decision(id=uuid.uuid4().hex, ts=time.time(), host="h1", container=container,
                           action=kw.pop("action", "limit"), policy="test", **kw))


def actuator(m: Managed, recorder) -> Actuator:
    return Actuator(settings(), CgroupBackend(m.layout), Ledger(":memory:"), recorder,
                    metrics=ActuatorMetrics(CollectorRegistry()), host_cores=2.0)


def test_set_limits_writes_the_cfs_quota_and_the_memory_limit(managed):
    managed.container("job", alloc_mib=1)
    backend = CgroupBackend(managed.layout)
    out = backend.apply(SetLimits("job", cpu_cores=0.75, mem_bytes=512 * MiB))
    assert out.status == "applied", out.message
    assert managed.file("job", "cpu", "cpu.cfs_period_us").read_text().strip() == "100000"
    assert managed.file("job", "cpu", "cpu.cfs_quota_us").read_text().strip() == "75000"
    assert int(managed.file("job", "memory", "memory.limit_in_bytes").read_text()) == 512 * MiB
    assert (out.cpu_cores, out.mem_bytes) == (0.75, 512 * MiB)


def test_memory_usage_reads_the_working_set_of_a_real_process(managed):
    managed.container("job", alloc_mib=100)
    usage = CgroupBackend(managed.layout).memory_usage("job")
    assert 100 * MiB <= usage < 200 * MiB


def test_a_memory_limit_below_usage_is_clamped_to_usage_plus_margin(managed, recorder):
    managed.container("job", alloc_mib=100)
    act = actuator(managed, recorder).handle(decision("job", mem_limit_bytes=10 * MiB), None, 0, 0)
    assert act.status == "clamped", act.message
    assert "current usage" in act.message and "margin 64.0 MiB" in act.message
    limit = int(managed.file("job", "memory", "memory.limit_in_bytes").read_text())
    assert limit == act.mem_limit_bytes
    assert 164 * MiB <= limit < 264 * MiB
    assert recorder.actuations() == [act]


def test_the_kernel_refusing_a_limit_below_usage_is_a_permanent_failure(managed):
    managed.container("job", alloc_mib=100)
    out = CgroupBackend(managed.layout).apply(SetLimits("job", mem_bytes=10 * MiB))  # safety bypassed
    assert out.status == "failed" and not out.temporary  # permanent: not retried
    assert "EBUSY" in out.message


def test_freeze_stops_a_process_accumulating_cpu_and_thaw_resumes_it(managed):
    managed.container("job", mode="burn")
    backend = CgroupBackend(managed.layout)
    usage = managed.file("job", "cpuacct", "cpuacct.usage")
    state = managed.file("job", "freezer", "freezer.state")

    def cpu_over(seconds: float) -> int:
        a = int(usage.read_text())
        time.sleep(seconds)
        return int(usage.read_text()) - a

    # (the machine is shared: a running burner gets some CPU, not necessarily a whole core)
    assert cpu_over(0.5) > 0.02e9
    assert backend.apply(Freeze("job")).status == "applied"
    assert state.read_text().strip() == "FROZEN"
    assert cpu_over(0.5) == 0
    assert backend.apply(Thaw("job")).status == "applied"
    assert state.read_text().strip() == "THAWED"
    assert cpu_over(0.5) > 0.02e9


def test_containers_outside_the_prefix_or_missing_are_rejected_and_untouched(managed, recorder):
    other = Managed()  # a sibling prefix the actuator must not reach
    try:
        other.container("victim")
        quota = other.file("victim", "cpu", "cpu.cfs_quota_us")
        before = quota.read_text()
        a = actuator(managed, recorder)
        for c in (f"../{other.layout.prefix}/victim", "victim", "no-such-job"):
            act = a.handle(decision(c, cpu_limit_cores=0.5), None, 0, 0)
            assert act.status == "rejected", (c, act)
        assert quota.read_text() == before
        assert "not a managed container name" in recorder.actuations()[0].message
        assert "does not exist" in recorder.actuations()[1].message
    finally:
        other.close()
