"""Read one managed container's cumulative cgroup counters (cgroup v1 and v2).

Parsing is pure (functions on strings, tested without a cgroup tree); file
access is :func:`read_container`, which the host agent calls once per
container per tick. Which file gives which quantity: docs/operations.md,
"What it reads".

>>> parse_v2_cpu_max("50000 100000"), parse_v2_cpu_max("max 100000"), working_set(10, 30)
(0.5, None, 0)
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.records import MAX_BYTES, MAX_CORES

__all__ = [
    "CgroupCounters",
    "holds_no_process",
    "parse_int",
    "parse_keyed",
    "parse_oom_kills",
    "parse_v1_cpu_limit",
    "parse_v1_cpu_usage",
    "parse_v1_mem_limit",
    "parse_v1_throttling",
    "parse_v2_cpu_max",
    "parse_v2_cpu_usage",
    "parse_v2_mem_max",
    "parse_v2_throttling",
    "read_container",
    "working_set",
]

#: v1 reports "no limit" as LONG_MAX rounded down to the page size
#: (9223372036854771712 on 4 KiB pages); anything this large is unlimited.
V1_UNLIMITED_BYTES = 2**62


@dataclass(frozen=True, slots=True)
class CgroupCounters:
    """One reading of a container's cgroup; counters are cumulative since creation."""

    container: str
    cpu_usage_s: float  #: CPU time used, seconds (cumulative)
    mem_bytes: int  #: working set now, bytes
    nr_periods: int = 0  #: CFS periods elapsed (cumulative)
    nr_throttled: int = 0  #: CFS periods throttled (cumulative)
    throttled_s: float = 0.0  #: time throttled, seconds (cumulative)
    oom_kills: int = 0  #: OOM kills (cumulative)
    cpu_limit_cores: float | None = None  #: None = unlimited
    mem_limit_bytes: int | None = None  #: None = unlimited


# --------------------------------------------------------------------------- pure parsing


def parse_int(text: str, what: str = "value") -> int:
    """One integer from a single-value cgroup file.

    >>> parse_int("123\\n")
    123
    """
    try:
        return int(text.strip())
    except ValueError:
        raise CgroupError(f"{what}: expected an integer, got {text.strip()[:60]!r}") from None


def parse_keyed(text: str, what: str = "file") -> dict[str, int]:
    """A flat-keyed cgroup file (``cpu.stat``, ``memory.stat``, ``memory.events``, ...).

    >>> parse_keyed("nr_periods 5\\nnr_throttled 2\\n")
    {'nr_periods': 5, 'nr_throttled': 2}
    """
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise CgroupError(f"{what}: line {n} is not 'key value': {line[:60]!r}")
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            raise CgroupError(f"{what}: line {n} value is not an integer: {line[:60]!r}") from None
    return out


def working_set(usage_bytes: int, inactive_file_bytes: int) -> int:
    """Usage minus inactive page cache (what the kernel cannot reclaim cheaply), never below 0."""
    return max(0, usage_bytes - inactive_file_bytes)


def parse_v1_cpu_usage(text: str) -> float:
    """``cpuacct.usage`` (ns) -> seconds.

    >>> parse_v1_cpu_usage("1500000000")
    1.5
    """
    return parse_int(text, "cpuacct.usage") / 1e9


def parse_v2_cpu_usage(stat: dict[str, int]) -> float:
    """``cpu.stat`` ``usage_usec`` -> seconds.

    >>> parse_v2_cpu_usage({"usage_usec": 2500000})
    2.5
    """
    if "usage_usec" not in stat:
        raise CgroupError("cpu.stat: no usage_usec line")
    return stat["usage_usec"] / 1e6


def parse_v1_throttling(stat: dict[str, int]) -> tuple[int, int, float]:
    """v1 ``cpu.stat`` -> (nr_periods, nr_throttled, throttled seconds); absent keys are 0.

    >>> parse_v1_throttling({"nr_periods": 10, "nr_throttled": 4, "throttled_time": 300000000})
    (10, 4, 0.3)
    """
    return stat.get("nr_periods", 0), stat.get("nr_throttled", 0), stat.get("throttled_time", 0) / 1e9


def parse_v2_throttling(stat: dict[str, int]) -> tuple[int, int, float]:
    """v2 ``cpu.stat`` -> (nr_periods, nr_throttled, throttled seconds); absent keys are 0.

    >>> parse_v2_throttling({"nr_periods": 10, "nr_throttled": 4, "throttled_usec": 300000})
    (10, 4, 0.3)
    """
    return stat.get("nr_periods", 0), stat.get("nr_throttled", 0), stat.get("throttled_usec", 0) / 1e6


def _cores(quota: int, period: int) -> float | None:
    if period <= 0:
        raise CgroupError(f"CFS period must be > 0, got {period}")
    cores = quota / period
    return None if cores > MAX_CORES else cores


def parse_v1_cpu_limit(quota_text: str, period_text: str) -> float | None:
    """``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` -> cores; quota -1 = unlimited (None).

    >>> parse_v1_cpu_limit("20000", "100000")
    0.2
    >>> parse_v1_cpu_limit("-1", "100000") is None
    True
    """
    quota = parse_int(quota_text, "cpu.cfs_quota_us")
    period = parse_int(period_text, "cpu.cfs_period_us")
    if quota < 0:
        return None
    return _cores(quota, period)


def parse_v2_cpu_max(text: str) -> float | None:
    """``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> cores; "max" = unlimited (None)."""
    parts = text.split()
    if len(parts) not in (1, 2):
        raise CgroupError(f"cpu.max: expected 'QUOTA PERIOD', got {text.strip()[:60]!r}")
    if parts[0] == "max":
        return None
    quota = parse_int(parts[0], "cpu.max quota")
    period = parse_int(parts[1], "cpu.max period") if len(parts) == 2 else 100_000
    return _cores(quota, period)


def parse_v1_mem_limit(text: str) -> int | None:
    """``memory.limit_in_bytes`` -> bytes; the page-rounded LONG_MAX (>= 2**62) = unlimited.

    >>> parse_v1_mem_limit("9223372036854771712") is None
    True
    >>> parse_v1_mem_limit("536870912")
    536870912
    """
    v = parse_int(text, "memory.limit_in_bytes")
    if v >= V1_UNLIMITED_BYTES or v > MAX_BYTES:
        return None
    return v


def parse_v2_mem_max(text: str) -> int | None:
    """``memory.max`` -> bytes; "max" = unlimited (None).

    >>> parse_v2_mem_max("max\\n") is None
    True
    """
    if text.strip() == "max":
        return None
    v = parse_int(text, "memory.max")
    return None if v > MAX_BYTES else v


def parse_oom_kills(text: str, what: str = "memory.events") -> int:
    """``oom_kill N`` from v1 ``memory.oom_control`` or v2 ``memory.events``; absent = 0.

    >>> parse_oom_kills("oom_kill_disable 0\\nunder_oom 0\\noom_kill 3\\n", "memory.oom_control")
    3
    """
    return parse_keyed(text, what).get("oom_kill", 0)


# --------------------------------------------------------------------------- file access


class _Missing(Exception):
    """An essential file is gone: the container vanished, or a controller is off."""

    def __init__(self, path: Path) -> None:
        self.path = path


_GONE = (errno.ENOENT, errno.ENODEV, errno.ESRCH)


def _read(path: Path, *, optional: bool = False) -> str | None:
    try:
        return path.read_text()
    except OSError as e:
        if e.errno in _GONE:
            if optional:
                return None
            raise _Missing(path) from None
        raise CgroupError(f"cannot read {path}: {e}") from e


def read_container(layout: CgroupLayout, container: str) -> CgroupCounters | None:
    """Read *container*'s counters now; ``None`` if its cgroup is gone.

    Raises :class:`CgroupError` for a cgroup that exists but cannot be read or
    parsed (the message names the file).
    """
    try:
        if layout.version == 2:
            return _read_v2(layout, container)
        return _read_v1(layout, container)
    except _Missing as m:
        try:
            still_there = layout.exists(container) and m.path.parent.is_dir()
        except (OSError, CgroupError):
            still_there = False
        if not still_there:
            return None
        raise CgroupError(
            f"{m.path} is missing although {m.path.parent} exists (is the controller enabled?)"
        ) from None


def holds_no_process(layout: CgroupLayout, container: str) -> bool:
    """True only where *container*'s cgroup is known to hold no process now: v2 ``cgroup.events`` says
    ``populated 0`` (it counts the cgroups below it too); v1 its ``cgroup.procs`` (cpuacct) is empty and it
    has no cgroup below it. False where that cannot be told (a file missing or unreadable, a v1 cgroup with
    children): such a cgroup is read as before.

    An empty cgroup is a container that is not running: a job that ended (the actuator leaves a started
    job's cgroups in place) or one waiting to be resumed. Its samples would show an idle container, which
    the worker would decide limits for and cut, and a resumed job would start under those cuts.
    """
    try:
        if layout.version == 2:
            return _populated_v2(layout.path(container)) is False
        d = layout.path(container, "cpuacct")
        if (d / "cgroup.procs").read_text().strip():
            return False
        return not any(c.is_dir() for c in d.iterdir())
    except (OSError, CgroupError):
        return False


def _populated_v2(d: Path) -> bool | None:
    try:
        text = (d / "cgroup.events").read_text()
    except OSError:
        return None
    try:
        v = parse_keyed(text, "cgroup.events").get("populated")
    except CgroupError:
        return None
    return None if v is None else v != 0


def _read_v1(layout: CgroupLayout, name: str) -> CgroupCounters:
    cpu = layout.path(name, "cpu")
    acct = layout.path(name, "cpuacct")
    mem = layout.path(name, "memory")
    usage_s = parse_v1_cpu_usage(_read(acct / "cpuacct.usage"))  # type: ignore[arg-type]
    mem_usage = parse_int(_read(mem / "memory.usage_in_bytes"), "memory.usage_in_bytes")  # type: ignore[arg-type]
    mstat = parse_keyed(_read(mem / "memory.stat"), "memory.stat")  # type: ignore[arg-type]
    cstat_text = _read(cpu / "cpu.stat", optional=True)
    periods, throttled, throttled_s = parse_v1_throttling(parse_keyed(cstat_text or "", "cpu.stat"))
    quota = _read(cpu / "cpu.cfs_quota_us", optional=True)
    period = _read(cpu / "cpu.cfs_period_us", optional=True)
    cpu_limit = parse_v1_cpu_limit(quota, period) if quota is not None and period is not None else None
    limit_text = _read(mem / "memory.limit_in_bytes", optional=True)
    oom_text = _read(mem / "memory.oom_control", optional=True)
    return CgroupCounters(
        container=name,
        cpu_usage_s=usage_s,
        mem_bytes=working_set(mem_usage, mstat.get("total_inactive_file", 0)),
        nr_periods=periods,
        nr_throttled=throttled,
        throttled_s=throttled_s,
        oom_kills=parse_oom_kills(oom_text, "memory.oom_control") if oom_text is not None else 0,
        cpu_limit_cores=cpu_limit,
        mem_limit_bytes=parse_v1_mem_limit(limit_text) if limit_text is not None else None,
    )


def _read_v2(layout: CgroupLayout, name: str) -> CgroupCounters:
    d = layout.path(name)
    cstat = parse_keyed(_read(d / "cpu.stat"), "cpu.stat")  # type: ignore[arg-type]
    mem_usage = parse_int(_read(d / "memory.current"), "memory.current")  # type: ignore[arg-type]
    mstat = parse_keyed(_read(d / "memory.stat"), "memory.stat")  # type: ignore[arg-type]
    periods, throttled, throttled_s = parse_v2_throttling(cstat)
    cpu_max = _read(d / "cpu.max", optional=True)
    mem_max = _read(d / "memory.max", optional=True)
    events = _read(d / "memory.events", optional=True)
    return CgroupCounters(
        container=name,
        cpu_usage_s=parse_v2_cpu_usage(cstat),
        mem_bytes=working_set(mem_usage, mstat.get("inactive_file", 0)),
        nr_periods=periods,
        nr_throttled=throttled,
        throttled_s=throttled_s,
        oom_kills=parse_oom_kills(events, "memory.events") if events is not None else 0,
        cpu_limit_cores=parse_v2_cpu_max(cpu_max) if cpu_max is not None else None,
        mem_limit_bytes=parse_v2_mem_max(mem_max) if mem_max is not None else None,
    )
