"""The demo's cgroups: the layout it may write, the directories a run owns, its jobs' starting limits.

docs/operations.md ("The demo") says what a run makes and removes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout

__all__ = ["DEFAULT_PREFIX", "NEED_ROOT", "DemoError", "check_cgroups", "clear_stale", "local_nodes", "owned_dirs",
           "read_limits", "set_limits"]

NEED_ROOT = "the demo needs root to create cgroups; run `sudo make demo`"


class DemoError(RuntimeError):
    """The demo cannot start or a part of it failed; ``str(e)`` says what to do."""


#: the demo's cgroup prefix (the roles' default is phasewise's own, ``phasewise``)
DEFAULT_PREFIX = "phasewise-demo"


def local_nodes(cpus: list[int]) -> str:
    """``place --local-nodes``: this host's CPUs as two cpuset slices (one where it has one CPU).

    >>> local_nodes([0, 1]), local_nodes([0, 1, 2]), local_nodes([3])
    ('s0=0;s1=1', 's0=0;s1=1,2', 's0=3')
    """
    half = len(cpus) // 2
    parts = [cpus[:half], cpus[half:]] if half else [cpus]
    return ";".join(f"s{i}=" + ",".join(map(str, p)) for i, p in enumerate(parts))


def check_cgroups(root: str, prefix: str) -> CgroupLayout:
    """A layout under *root* we may write, or :class:`DemoError` saying why not."""
    if os.geteuid() != 0:
        raise DemoError(NEED_ROOT)
    try:
        layout = CgroupLayout(root, prefix)
    except CgroupError as e:
        raise DemoError(f"{e}; the demo needs a writable cgroup v1 or v2 hierarchy at --cgroup-root") from e
    if layout.version == 1:
        have = set(layout.controllers())
        missing = {"cpu", "cpuacct", "memory"} - have
        if missing:
            raise DemoError(f"cgroup v1 controllers {sorted(missing)} are not mounted under {root}")
        for c in ("cpu", "memory"):
            if not os.access(layout.controller_root(c), os.W_OK):
                raise DemoError(f"{layout.controller_root(c)} is not writable; {NEED_ROOT}")
    else:
        avail = set((Path(root) / "cgroup.controllers").read_text().split())
        if not {"cpu", "memory"} <= avail:
            raise DemoError(f"the cgroup2 mount {root} lacks the cpu and memory controllers "
                            f"(has: {' '.join(sorted(avail)) or 'none'})")
        if not os.access(root, os.W_OK):
            raise DemoError(f"{root} is not writable; {NEED_ROOT}")
    return layout


def _end_processes(layout: CgroupLayout, name: str, grace_s: float = 5.0) -> None:
    """SIGTERM the processes of *name*'s cgroup, SIGKILL what is left after *grace_s*, wait until it is empty."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = layout.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while layout.pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not layout.pids(name):
            return
    raise DemoError(f"the processes of {name} did not end: {layout.pids(name)}")


def _bases(layout: CgroupLayout) -> list[Path]:
    if layout.version == 2:
        return [layout.root / layout.prefix]
    return [layout.base(c) for c in layout.controllers()]


def clear_stale(layout: CgroupLayout) -> list[str]:
    """Remove empty cgroups a crashed earlier demo left under the prefix."""
    removed = []
    for base in _bases(layout):
        if not base.is_dir():
            continue
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            procs = (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else []
            if procs:
                raise DemoError(f"{d} still has processes {' '.join(procs)}: is another demo running? "
                                f"Use --cgroup-prefix to run beside it.")
            d.rmdir()
            removed.append(str(d))
    return removed


def owned_dirs(layout: CgroupLayout) -> list[Path]:
    """The directories a run taking the prefix owns, deepest first: the prefix in each hierarchy, and
    its parents that do not exist yet (a nested ``--cgroup-prefix a/b`` makes ``a`` too)."""
    out: list[Path] = []
    tops = [layout.root] if layout.version == 2 else [layout.controller_root(c) for c in layout.controllers()]
    extra = []
    if layout.version == 1 and "cpuset" not in layout.controllers():  # the actuator's cpuset slices (--submit)
        cpuset = layout.controller_root("cpuset")
        if cpuset.is_dir() and not (cpuset / layout.prefix).exists():
            extra.append(cpuset)
    for top in [*tops, *extra]:
        base = top / layout.prefix
        out.append(base)
        d = base.parent
        while d != top and not d.exists():
            out.append(d)
            d = d.parent
    return out


def set_limits(layout: CgroupLayout, name: str, cpu_cores: float, mem_bytes: int) -> None:
    """Write the starting limits straight into the job's cgroup files."""
    period = 100_000
    quota = max(1_000, round(cpu_cores * period))
    if layout.version == 2:
        d = layout.path(name)
        (d / "cpu.max").write_text(f"{quota} {period}")
        (d / "memory.max").write_text(str(mem_bytes))
    else:
        cpu = layout.path(name, "cpu")
        (cpu / "cpu.cfs_period_us").write_text(str(period))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        (layout.path(name, "memory") / "memory.limit_in_bytes").write_text(str(mem_bytes))


def read_limits(layout: CgroupLayout, name: str) -> tuple[float | None, float | None]:
    from phasewise.producers.cgroup_reader import read_container

    c = read_container(layout, name)
    return (None, None) if c is None else (c.cpu_limit_cores, c.mem_limit_bytes)
