"""HostSampler: deltas between calls on fixture trees, and a real v1 cgroup with a CPU burner."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.records import HostSamples, decode, encode
from phasewise.producers.sampler import HostSampler
from tests.conftest import requires_root


class Clock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sampler_for(tree, clock: Clock | None = None) -> HostSampler:
    kw = {"monotonic": clock} if clock else {}
    return HostSampler(tree.layout, host="h1", clock=lambda: 1_700_000_000.0, gpu=False, **kw)


def by_name(msg: HostSamples) -> dict:
    return {c.container: c for c in msg.containers}


def test_a_new_container_is_omitted_until_it_has_an_interval(cgtree):
    clock = Clock()
    cgtree.set("job-a", cpu_s=10.0, mem=4096)
    s = sampler_for(cgtree, clock)
    first = s.sample()
    assert first.containers == () and first.interval_s == 0.0
    clock.t += 2.0
    cgtree.set("job-a", cpu_s=13.0, mem=8192)
    second = s.sample()
    assert list(by_name(second)) == ["job-a"]
    assert second.interval_s == pytest.approx(2.0)


def test_cpu_cores_and_counters_are_deltas_over_the_interval(cgtree):
    clock = Clock()
    cgtree.set("job-a", cpu_s=10.0, mem=500, inactive_file=100, periods=100, throttled=10, throttled_s=1.0, oom=1,
               quota_us=150_000, mem_limit=2**30)
    s = sampler_for(cgtree, clock)
    s.sample()
    clock.t += 2.0
    cgtree.set("job-a", cpu_s=13.0, mem=900, inactive_file=100, periods=120, throttled=25, throttled_s=1.6, oom=3,
               quota_us=150_000, mem_limit=2**30)
    c = by_name(s.sample())["job-a"]
    assert c.cpu_cores == pytest.approx(1.5)
    assert c.mem_bytes == 800
    assert (c.nr_periods, c.throttled_periods, c.oom_events) == (20, 15, 2)
    assert c.throttled_s == pytest.approx(0.6)
    assert c.cpu_limit_cores == pytest.approx(1.5)
    assert c.mem_limit_bytes == 2**30
    assert c.gpu_util is None and c.gpu_mem_bytes is None


def test_a_recreated_container_never_yields_negative_values(cgtree):
    clock = Clock()
    cgtree.set("job-a", cpu_s=100.0, periods=500, oom=2)
    s = sampler_for(cgtree, clock)
    s.sample()
    clock.t += 1.0
    cgtree.remove("job-a")
    cgtree.set("job-a", cpu_s=0.5, periods=3)  # same name, fresh counters
    after_reset = s.sample()
    assert "job-a" not in by_name(after_reset)  # new baseline, nothing published
    clock.t += 1.0
    cgtree.set("job-a", cpu_s=1.0, periods=13)
    c = by_name(s.sample())["job-a"]
    assert c.cpu_cores == pytest.approx(0.5) and c.nr_periods == 10 and c.oom_events == 0


def test_a_container_that_vanishes_between_samples_is_absent_and_nothing_raises(cgtree):
    clock = Clock()
    cgtree.set("job-a", cpu_s=1.0)
    cgtree.set("job-b", cpu_s=1.0)
    s = sampler_for(cgtree, clock)
    s.sample()
    clock.t += 1.0
    cgtree.remove("job-a")
    msg = s.sample()
    assert list(by_name(msg)) == ["job-b"]
    # and it round-trips through the wire format
    assert decode(HostSamples, encode(msg)) == msg


def test_an_unreadable_container_is_skipped_and_the_others_still_sampled(v2tree, caplog):
    clock = Clock()
    v2tree.set("job-a", cpu_s=1.0)
    v2tree.set("job-b", cpu_s=1.0)
    s = sampler_for(v2tree, clock)
    s.sample()
    clock.t += 1.0
    (v2tree.dirs("job-a")[0] / "cpu.stat").write_text("usage_usec garbage\n")
    msg = s.sample()
    assert list(by_name(msg)) == ["job-b"]
    assert "container job-a skipped" in caplog.text


def test_host_fields_come_from_psutil_deltas(v2tree):
    from collections import namedtuple

    Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
    VM = namedtuple("VM", "total available")

    class FakePsutil:
        busy = 100.0

        def cpu_times(self):
            return Times(self.busy, 0, 0, 900.0, 5.0, 0, 0, 0, 50.0, 0)

        def virtual_memory(self):
            return VM(16 * 2**30, 12 * 2**30)

        def cpu_count(self):
            return 8

    ps = FakePsutil()
    clock = Clock()
    s = HostSampler(v2tree.layout, host="h1", gpu=False, monotonic=clock, psutil=ps)
    first = s.sample()
    assert first.host_cpu_cores is None and first.host_cpu_count == 8
    assert first.host_mem_bytes == 4 * 2**30 and first.host_mem_total_bytes == 16 * 2**30
    clock.t += 2.0
    ps.busy = 106.0
    assert s.sample().host_cpu_cores == pytest.approx(3.0)


def test_a_missing_managed_prefix_gives_empty_samples_not_errors(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    s = HostSampler(CgroupLayout(tmp_path, "absent"), host="h1", gpu=False)
    assert s.sample().containers == ()
    assert s.sample().containers == ()


# --------------------------------------------------------------------------- real cgroup v1

#: joins the cgroups named on its command line, then allocates 32 MiB there and burns a core
BURN = (
    "import os, sys\n"
    "for f in sys.argv[1:]:\n"
    "    open(f, 'w').write(str(os.getpid()))\n"
    "x = b'\\x01' * (32 * 2**20)\n"
    "while True:\n"
    "    pass\n"
)


@pytest.fixture
def real_v1_layout():
    try:
        layout = CgroupLayout("/sys/fs/cgroup", prefix=f"pwtest-{uuid.uuid4().hex[:8]}")
    except CgroupError as e:
        pytest.skip(f"no cgroup mount: {e}")
    if layout.version != 1:
        pytest.skip("this host's /sys/fs/cgroup is not cgroup v1")
    yield layout
    for c in layout.controllers():
        base = layout.base(c)
        if base.exists():
            for d in base.iterdir():
                if d.is_dir():
                    d.rmdir()
            base.rmdir()


@requires_root
def test_a_real_v1_cgroup_with_a_cpu_burner_reads_one_core_then_throttles_under_quota(real_v1_layout):
    layout = real_v1_layout
    layout.create("burner")
    procs_files = [str(layout.path("burner", c) / "cgroup.procs") for c in layout.controllers()]
    proc = subprocess.Popen([sys.executable, "-c", BURN, *procs_files])
    try:
        time.sleep(0.3)  # let it start and touch its memory
        me = psutil.Process(proc.pid)

        def proc_cpu_s() -> float:
            t = me.cpu_times()
            return t.user + t.system

        s = HostSampler(layout, host="h1", gpu=False)
        c0, w0 = proc_cpu_s(), time.monotonic()
        s.sample()
        time.sleep(1.0)
        free = {c.container: c for c in s.sample().containers}["burner"]
        own_rate = (proc_cpu_s() - c0) / (time.monotonic() - w0)
        # one busy loop: about one core on an idle host; on a loaded shared host it gets less, so the
        # cgroup figure is also checked against the process's own CPU time (/proc/<pid>/stat)
        assert 0.2 < free.cpu_cores < 1.5, free
        assert free.cpu_cores == pytest.approx(own_rate, abs=0.1), (free, own_rate)
        assert free.mem_bytes > 16 * 2**20, free
        assert free.cpu_limit_cores is None

        cpu_dir: Path = layout.path("burner", "cpu")
        (cpu_dir / "cpu.cfs_quota_us").write_text("20000")  # 0.2 cores of a 100 ms period
        s.sample()  # start an interval that lies wholly under the quota
        time.sleep(1.0)
        capped = {c.container: c for c in s.sample().containers}["burner"]
        assert capped.cpu_limit_cores == pytest.approx(0.2)
        assert capped.throttled_periods > 0 and capped.nr_periods >= capped.throttled_periods, capped
        assert capped.throttled_s > 0
        assert capped.cpu_cores < 0.4, capped
    finally:
        proc.kill()
        proc.wait()
        layout.remove("burner")


def sleeper_in(layout: CgroupLayout, container: str) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "600"])
    layout.attach(container, p.pid)
    return p


@requires_root
def test_a_real_v1_cgroup_removed_between_samples_is_absent(real_v1_layout):
    layout = real_v1_layout
    layout.create("short")
    layout.create("long")
    procs = [sleeper_in(layout, "short"), sleeper_in(layout, "long")]
    s = HostSampler(layout, host="h1", gpu=False)
    try:
        s.sample()
        time.sleep(0.1)
        assert {c.container for c in s.sample().containers} == {"short", "long"}
        procs[0].kill()
        procs[0].wait()
        layout.remove("short")
        assert {c.container for c in s.sample().containers} == {"long"}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    layout.remove("long")


@requires_root
def test_a_real_v1_cgroup_whose_processes_ended_is_not_sampled_until_one_runs_in_it_again(real_v1_layout):
    """A job that ended (its cgroup left in place) or waits to be resumed is not a running container: its
    idle readings would have the worker cut its limits. A process in it again: a new container (a baseline
    first), as after it was recreated."""
    layout = real_v1_layout
    layout.create("job")
    layout.create("parent")
    (layout.path("parent", "cpuacct") / "child").mkdir()  # no process of its own, a cgroup below: unknown
    p = sleeper_in(layout, "job")
    s = HostSampler(layout, host="h1", gpu=False)
    try:
        s.sample()
        time.sleep(0.1)
        assert {c.container for c in s.sample().containers} == {"job", "parent"} and s.empty == 0
        p.kill()
        p.wait()
        assert {c.container for c in s.sample().containers} == {"parent"} and s.empty == 1
        p = sleeper_in(layout, "job")
        assert {c.container for c in s.sample().containers} == {"parent"} and s.empty == 0  # first sight
        time.sleep(0.1)
        assert {c.container for c in s.sample().containers} == {"job", "parent"}
    finally:
        p.kill()
        p.wait()
        (layout.path("parent", "cpuacct") / "child").rmdir()
    layout.remove("job")
    layout.remove("parent")


def test_a_v2_cgroup_that_says_it_is_unpopulated_is_skipped_and_one_that_cannot_tell_is_read(v2tree):
    clock = Clock()
    for name in ("running", "ended", "unknown"):
        v2tree.set(name, cpu_s=1.0)
    d = lambda name: v2tree.dirs(name)[0]  # noqa: E731
    (d("running") / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    (d("ended") / "cgroup.events").write_text("populated 0\nfrozen 0\n")
    s = sampler_for(v2tree, clock)
    s.sample()
    clock.t += 1.0
    assert set(by_name(s.sample())) == {"running", "unknown"} and s.empty == 1
    (d("unknown") / "cgroup.events").write_text("not a keyed file at all\n")  # unreadable: read as before
    clock.t += 1.0
    assert set(by_name(s.sample())) == {"running", "unknown"}

