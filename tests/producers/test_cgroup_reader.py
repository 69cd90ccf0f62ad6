"""The cgroup reader: every file format from strings, then fixture trees of v1 and v2."""

from __future__ import annotations

import shutil

import pytest

from phasewise.kit.cgroups.fs import CgroupError
from phasewise.producers import cgroup_reader as cr
from phasewise.producers.cgroup_reader import read_container

# --------------------------------------------------------------------------- parsing (strings)


def test_v1_cpuacct_usage_nanoseconds_become_seconds():
    assert cr.parse_v1_cpu_usage("123456789012\n") == pytest.approx(123.456789012)


def test_v2_cpu_stat_usage_usec_becomes_seconds():
    stat = cr.parse_keyed("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert cr.parse_v2_cpu_usage(stat) == 2.5


def test_v2_cpu_stat_without_usage_is_an_error_naming_the_field():
    with pytest.raises(CgroupError, match="usage_usec"):
        cr.parse_v2_cpu_usage(cr.parse_keyed("nr_periods 1\n"))


def test_v1_cpu_stat_throttling_in_nanoseconds():
    stat = cr.parse_keyed("nr_periods 120\nnr_throttled 30\nthrottled_time 1500000000\nnr_bursts 0\nburst_time 0\n")
    assert cr.parse_v1_throttling(stat) == (120, 30, 1.5)


def test_v2_cpu_stat_throttling_in_microseconds():
    stat = cr.parse_keyed("usage_usec 5\nnr_periods 120\nnr_throttled 30\nthrottled_usec 1500000\n")
    assert cr.parse_v2_throttling(stat) == (120, 30, 1.5)


def test_cpu_stat_without_cfs_lines_means_no_throttling():
    assert cr.parse_v2_throttling(cr.parse_keyed("usage_usec 5\nuser_usec 3\nsystem_usec 2\n")) == (0, 0, 0.0)


def test_v1_quota_over_period_gives_cores_and_minus_one_is_unlimited():
    assert cr.parse_v1_cpu_limit("20000\n", "100000\n") == pytest.approx(0.2)
    assert cr.parse_v1_cpu_limit("250000", "100000") == pytest.approx(2.5)
    assert cr.parse_v1_cpu_limit("-1\n", "100000\n") is None


def test_v2_cpu_max_gives_cores_and_max_is_unlimited():
    assert cr.parse_v2_cpu_max("50000 100000\n") == 0.5
    assert cr.parse_v2_cpu_max("max 100000\n") is None
    assert cr.parse_v2_cpu_max("150000 50000") == 3.0


def test_malformed_cpu_max_is_a_clear_error():
    with pytest.raises(CgroupError, match="cpu.max"):
        cr.parse_v2_cpu_max("lots of words here")
    with pytest.raises(CgroupError, match="cpu.max quota"):
        cr.parse_v2_cpu_max("half 100000")


def test_zero_cfs_period_is_rejected():
    with pytest.raises(CgroupError, match="period"):
        cr.parse_v1_cpu_limit("1000", "0")


def test_v1_memory_limit_page_rounded_max_and_huge_values_are_unlimited():
    assert cr.parse_v1_mem_limit("9223372036854771712\n") is None  # LONG_MAX rounded to 4 KiB
    assert cr.parse_v1_mem_limit("9223372036854710272\n") is None  # LONG_MAX rounded to 64 KiB
    assert cr.parse_v1_mem_limit(str(2**62)) is None
    assert cr.parse_v1_mem_limit("536870912\n") == 536870912


def test_v2_memory_max_is_bytes_or_unlimited():
    assert cr.parse_v2_mem_max("max\n") is None
    assert cr.parse_v2_mem_max("1073741824\n") == 2**30


def test_oom_kills_from_v1_oom_control_and_v2_memory_events():
    assert cr.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n", "memory.oom_control") == 4
    assert cr.parse_oom_kills("low 0\nhigh 3\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n") == 2
    assert cr.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0  # kernels before 4.13


def test_working_set_subtracts_inactive_file_and_never_goes_negative():
    assert cr.working_set(10_000, 2_500) == 7_500
    assert cr.working_set(1_000, 5_000) == 0


def test_garbage_in_a_keyed_file_names_file_and_line():
    with pytest.raises(CgroupError, match=r"memory.stat: line 2"):
        cr.parse_keyed("cache 1\ntotal_inactive_file lots\n", "memory.stat")
    with pytest.raises(CgroupError, match="cpuacct.usage"):
        cr.parse_v1_cpu_usage("not-a-number")


# --------------------------------------------------------------------------- fixture trees


def test_reader_returns_every_counter_from_a_fixture_tree(cgtree):
    cgtree.set("job-a", cpu_s=12.5, mem=300 * 2**20, inactive_file=100 * 2**20, periods=40, throttled=10,
               throttled_s=0.75, oom=2, quota_us=50_000, period_us=100_000, mem_limit=2**30)
    c = read_container(cgtree.layout, "job-a")
    assert c is not None
    assert c.container == "job-a"
    assert c.cpu_usage_s == pytest.approx(12.5)
    assert c.mem_bytes == 200 * 2**20
    assert (c.nr_periods, c.nr_throttled) == (40, 10)
    assert c.throttled_s == pytest.approx(0.75)
    assert c.oom_kills == 2
    assert c.cpu_limit_cores == pytest.approx(0.5)
    assert c.mem_limit_bytes == 2**30


def test_reader_reports_unlimited_limits_as_none(cgtree):
    cgtree.set("job-a", cpu_s=1.0, mem=4096)
    c = read_container(cgtree.layout, "job-a")
    assert c is not None and c.cpu_limit_cores is None and c.mem_limit_bytes is None


def test_a_vanished_container_reads_as_none(cgtree):
    cgtree.set("job-a", cpu_s=1.0, mem=4096)
    cgtree.remove("job-a")
    assert read_container(cgtree.layout, "job-a") is None


def test_v1_container_gone_from_one_controller_mid_read_reads_as_none(v1tree):
    """rmdir removes the cgroup controller by controller; a read in between must not raise."""
    v1tree.set("job-a", cpu_s=1.0, mem=4096)
    _cpu, _acct, mem = v1tree.dirs("job-a")
    shutil.rmtree(mem)
    assert read_container(v1tree.layout, "job-a") is None


def test_missing_essential_file_in_a_live_cgroup_is_an_error_not_a_vanish(v2tree):
    v2tree.set("job-a", cpu_s=1.0, mem=4096)
    (v2tree.dirs("job-a")[0] / "memory.current").unlink()  # memory controller not enabled
    with pytest.raises(CgroupError, match="memory.current is missing"):
        read_container(v2tree.layout, "job-a")


def test_optional_files_missing_mean_no_limit_and_no_events(v2tree):
    v2tree.set("job-a", cpu_s=1.0, mem=4096)
    d = v2tree.dirs("job-a")[0]
    for f in ("cpu.max", "memory.max", "memory.events"):
        (d / f).unlink()
    c = read_container(v2tree.layout, "job-a")
    assert c is not None and c.cpu_limit_cores is None and c.mem_limit_bytes is None and c.oom_kills == 0


def test_layout_lists_fixture_containers(cgtree):
    cgtree.set("job-a")
    cgtree.set("job-b")
    assert cgtree.layout.containers() == ["job-a", "job-b"]
