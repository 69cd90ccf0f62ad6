"""Fixture cgroup trees (v1 and v2) written into tmp_path, shaped like the kernel's files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from phasewise.kit.cgroups.fs import CgroupLayout

PREFIX = "phasewise"


class CgTree:
    """A fake cgroup mount: write a container's counters as the kernel would lay them out."""

    def __init__(self, root: Path, version: int, prefix: str = PREFIX) -> None:
        self.root, self.version, self.prefix = root, version, prefix
        if version == 2:
            (root / prefix).mkdir(parents=True)
            (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        else:
            for c in ("cpu", "cpuacct", "memory"):
                (root / c / prefix).mkdir(parents=True)
        self.layout = CgroupLayout(root, prefix)

    def dirs(self, name: str) -> list[Path]:
        if self.version == 2:
            return [self.root / self.prefix / name]
        return [self.root / c / self.prefix / name for c in ("cpu", "cpuacct", "memory")]

    def set(
        self,
        name: str,
        *,
        cpu_s: float = 0.0,
        mem: int = 0,
        inactive_file: int = 0,
        periods: int = 0,
        throttled: int = 0,
        throttled_s: float = 0.0,
        oom: int = 0,
        quota_us: int | None = None,
        period_us: int = 100_000,
        mem_limit: int | None = None,
    ) -> None:
        for d in self.dirs(name):
            d.mkdir(parents=True, exist_ok=True)
        if self.version == 2:
            d = self.dirs(name)[0]
            (d / "cpu.stat").write_text(
                f"usage_usec {round(cpu_s * 1e6)}\nuser_usec 1\nsystem_usec 1\n"
                f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_usec {round(throttled_s * 1e6)}\n"
            )
            (d / "memory.current").write_text(f"{mem}\n")
            (d / "memory.stat").write_text(f"anon 4096\nfile 8192\nactive_file 4096\ninactive_file {inactive_file}\n")
            (d / "cpu.max").write_text(f"{'max' if quota_us is None else quota_us} {period_us}\n")
            (d / "memory.max").write_text("max\n" if mem_limit is None else f"{mem_limit}\n")
            (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 2\noom 1\noom_kill {oom}\n")
            return
        cpu, acct, memd = self.dirs(name)
        (acct / "cpuacct.usage").write_text(f"{round(cpu_s * 1e9)}\n")
        (cpu / "cpu.stat").write_text(
            f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time {round(throttled_s * 1e9)}\n"
            "nr_bursts 0\nburst_time 0\n"
        )
        (cpu / "cpu.cfs_quota_us").write_text(f"{-1 if quota_us is None else quota_us}\n")
        (cpu / "cpu.cfs_period_us").write_text(f"{period_us}\n")
        (memd / "memory.usage_in_bytes").write_text(f"{mem}\n")
        # the non-hierarchical inactive_file differs on purpose: the reader must use total_*
        (memd / "memory.stat").write_text(
            f"cache 0\nrss 0\ninactive_file 1\nactive_file 0\ntotal_cache 0\ntotal_inactive_file {inactive_file}\n"
        )
        (memd / "memory.limit_in_bytes").write_text(
            "9223372036854771712\n" if mem_limit is None else f"{mem_limit}\n"
        )
        (memd / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom}\n")

    def remove(self, name: str) -> None:
        for d in self.dirs(name):
            shutil.rmtree(d)


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def cgtree(request, tmp_path) -> CgTree:
    """A fixture tree of each cgroup version."""
    return CgTree(tmp_path / "cgroup", request.param)


@pytest.fixture
def v1tree(tmp_path) -> CgTree:
    return CgTree(tmp_path / "cgroup", 1)


@pytest.fixture
def v2tree(tmp_path) -> CgTree:
    return CgTree(tmp_path / "cgroup", 2)
