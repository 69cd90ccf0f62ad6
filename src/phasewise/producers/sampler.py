"""Turn cumulative cgroup counters into one ``HostSamples`` per tick: rates since the previous reading.

:class:`HostSampler` keeps every container's previous reading; a container
seen for the first time, or whose counters went backwards, is left out of
that tick rather than reported as idle or negative. The rules and the host
fields: docs/operations.md, "What it reads".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.cgroups.fs import CgroupError, CgroupLayout
from phasewise.kit.records import MAX_BYTES, MAX_CORES, ContainerSample, HostSamples
from phasewise.producers.cgroup_reader import CgroupCounters, holds_no_process, read_container
from phasewise.producers.nvml import GpuReading, NvmlSampler

__all__ = ["HostSampler", "container_delta"]

log = logging.getLogger(__name__)


#: psutil.cpu_times fields that are CPU work (guest time is already inside user/nice)
_BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")


@dataclass(frozen=True, slots=True)
class _Seen:
    at: float  # monotonic seconds of the read
    counters: CgroupCounters


def _reset(prev: CgroupCounters, cur: CgroupCounters) -> bool:
    return (
        cur.cpu_usage_s < prev.cpu_usage_s
        or cur.nr_periods < prev.nr_periods
        or cur.nr_throttled < prev.nr_throttled
        or cur.throttled_s < prev.throttled_s
        or cur.oom_kills < prev.oom_kills
    )


def container_delta(prev: CgroupCounters, prev_at: float, cur: CgroupCounters, cur_at: float,
                    gpu: tuple[float, float] | None = None) -> ContainerSample | None:
    """The sample between two readings, or ``None`` if they span a counter reset or no time.

    Pure: the sampler's arithmetic, testable without any files.

    >>> a = CgroupCounters("j", cpu_usage_s=10.0, mem_bytes=100, nr_periods=10)
    >>> b = CgroupCounters("j", cpu_usage_s=12.0, mem_bytes=200, nr_periods=30, nr_throttled=5)
    >>> s = container_delta(a, 0.0, b, 2.0)
    >>> (s.cpu_cores, s.mem_bytes, s.nr_periods, s.throttled_periods)
    (1.0, 200.0, 20, 5)
    >>> container_delta(b, 2.0, a, 3.0) is None  # recreated: counters went backwards
    True
    """
    dt = cur_at - prev_at
    if dt <= 0 or _reset(prev, cur):
        return None
    cores = min((cur.cpu_usage_s - prev.cpu_usage_s) / dt, MAX_CORES)
    return ContainerSample(
        container=cur.container,
        cpu_cores=cores,
        mem_bytes=float(min(cur.mem_bytes, MAX_BYTES)),
        cpu_limit_cores=cur.cpu_limit_cores,
        mem_limit_bytes=None if cur.mem_limit_bytes is None else float(cur.mem_limit_bytes),
        throttled_periods=cur.nr_throttled - prev.nr_throttled,
        nr_periods=cur.nr_periods - prev.nr_periods,
        throttled_s=max(0.0, cur.throttled_s - prev.throttled_s),
        oom_events=cur.oom_kills - prev.oom_kills,
        gpu_util=None if gpu is None else gpu[0],
        gpu_mem_bytes=None if gpu is None else gpu[1],
    )


def _load_psutil() -> Any:
    import psutil

    return psutil


class HostSampler:
    """Sample every managed container of one host; one :class:`HostSamples` per call.

    Parameters
    ----------
    layout
        Where the managed containers' cgroups are.
    nvml
        An nvml module object (``pynvml``-compatible) or a ready
        :class:`NvmlSampler`; ``None`` tries the real ``pynvml``.
    proc_root
        ``/proc`` (or a fixture tree) for mapping GPU processes to containers.
    clock
        Event time (Unix seconds) stamped on each message.
    monotonic
        Clock for the intervals rates are computed over.
    host
        This host's name (the message key).
    gpu
        ``False`` disables NVML entirely (no GPU fields, no log line).
    psutil
        psutil-compatible module for host CPU/memory; ``None`` imports psutil.
    workloads
        Identity and policy of each container (:class:`~phasewise.kit.cgroups.workloads.Workloads`);
        ``None``: the identity the cgroup path gives, no policy.
    """

    def __init__(
        self,
        layout: CgroupLayout,
        nvml: Any = None,
        proc_root: str | os.PathLike = "/proc",
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        gpu: bool = True,
        psutil: Any = None,
        workloads: Any = None,
    ) -> None:
        self.layout = layout
        self.workloads = workloads
        self.host = host or socket.gethostname()
        self.clock = clock
        self.monotonic = monotonic
        if not gpu:
            self.gpu: NvmlSampler | None = None
        elif isinstance(nvml, NvmlSampler):
            self.gpu = nvml
        else:
            self.gpu = NvmlSampler(nvml, prefix=layout.prefix, proc_root=proc_root,
                                   layouts=layout.layouts, parent=layout.parent)
        self._psutil = psutil
        self._seen: dict[str, _Seen] = {}
        self._last_tick: float | None = None
        self._last_cpu: tuple[float, float] | None = None  # (monotonic, busy seconds)
        self._warned: set[str] = set()
        #: containers the last tick skipped: their cgroup holds no process (:func:`holds_no_process`)
        self.empty = 0

    # ------------------------------------------------------------------ host-wide

    def _host_stats(self, now: float) -> dict[str, Any]:
        try:
            ps = self._psutil or _load_psutil()
            self._psutil = ps
            t = ps.cpu_times()
            busy = sum(getattr(t, f, 0.0) for f in _BUSY_FIELDS)
            vm = ps.virtual_memory()
            count = ps.cpu_count() or 0
        except Exception as e:  # noqa: BLE001 - host stats are best effort, containers matter
            self._warn_once("psutil", "host CPU/memory unavailable: %s", e)
            return {}
        cores = None
        if self._last_cpu is not None and now > self._last_cpu[0]:
            cores = max(0.0, (busy - self._last_cpu[1]) / (now - self._last_cpu[0]))
            cores = min(cores, float(count) if count else MAX_CORES)
        self._last_cpu = (now, busy)
        return {
            "host_cpu_cores": cores,
            "host_cpu_count": count or None,
            "host_mem_bytes": float(min(max(vm.total - vm.available, 0), MAX_BYTES)),
            "host_mem_total_bytes": float(min(vm.total, MAX_BYTES)),
        }

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ------------------------------------------------------------------ one tick

    def sample(self) -> HostSamples:
        """Read every container and return the deltas since the previous call."""
        tick = self.monotonic()
        gpu: GpuReading | None = self.gpu.sample() if self.gpu is not None else None
        try:
            names = self.layout.containers()
        except (OSError, CgroupError) as e:
            self._warn_once("list", "cannot list containers under %s: %s", self.layout.root, e)
            names = []
        out: list[ContainerSample] = []
        seen: dict[str, _Seen] = {}
        empty = 0
        for name in names:
            if holds_no_process(self.layout, name):
                empty += 1  # not running (a job that ended, one waiting to resume): sampled again from its
                continue  # next process on, as a new container
            if self.workloads is not None:
                try:
                    who = self.workloads.describe(name)
                except Exception as e:  # noqa: BLE001 - one container's identity must not stop the tick
                    self._warn_once(f"who:{name}", "container %s: identity unavailable: %s", name, e)
                    who = (self.layout.identity(name), None)
                if who is None:
                    continue  # a pod's sandbox (pause) container: not a workload
            else:
                who = (self.layout.identity(name), None)
            try:
                cur = read_container(self.layout, name)
            except (OSError, CgroupError) as e:
                self._warn_once(f"read:{name}", "container %s skipped: %s", name, e)
                continue
            if cur is None:
                continue  # vanished while we looked
            at = self.monotonic()
            seen[name] = _Seen(at, cur)
            prev = self._seen.get(name)
            if prev is None:
                continue  # first sight: no interval yet
            g = None if gpu is None else gpu.containers.get(name, (0.0, 0.0))
            s = container_delta(prev.counters, prev.at, cur, at, g)
            if s is None:
                log.info("container %s: counters went backwards (recreated); new baseline", name)
                continue
            out.append(dataclasses.replace(s, identity=who[0], workload=who[1]))
        self._seen = seen  # containers that vanished (or hold no process) are forgotten
        self.empty = empty
        interval = 0.0 if self._last_tick is None else max(0.0, tick - self._last_tick)
        self._last_tick = tick
        return HostSamples(
            host=self.host,
            ts=self.clock(),
            interval_s=min(interval, 86400.0),
            containers=tuple(out),
            gpus=gpu.gpus if gpu is not None else (),
            **self._host_stats(self.monotonic()),
        )

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
