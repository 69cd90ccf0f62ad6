"""GPU sampling through NVML, with each GPU's use attributed to the managed containers by their processes' memory.

:class:`NvmlSampler` wraps an *nvml module object* (``pynvml`` by default,
a fake in tests) and returns per tick one ``GpuSample`` per GPU and each
container's GPU use; without NVML or a device it returns ``None`` and
samples carry no GPU fields. The attribution rule and how to check it on a
GPU host: docs/operations.md, "GPUs".
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phasewise.kit.cgroups.layouts import classify_proc_cgroup
from phasewise.kit.records import GpuSample

__all__ = ["GpuReading", "NvmlSampler", "container_from_cgroup_text", "container_of_pid", "load_pynvml"]

log = logging.getLogger(__name__)

_NAME_OK = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@-")


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One tick of GPU data: the host's GPUs and per-container (util %, memory bytes)."""

    gpus: tuple[GpuSample, ...] = ()
    containers: dict[str, tuple[float, float]] = field(default_factory=dict)


def load_pynvml() -> Any:
    """Import pynvml (which warns about its own deprecation on import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pynvml

    return pynvml


def container_from_cgroup_text(text: str, prefix: str) -> str | None:
    """The managed container named in a ``/proc/<pid>/cgroup`` file, or ``None``.

    >>> container_from_cgroup_text("0::/phasewise/job-a/worker\\n", "phasewise")
    'job-a'
    >>> container_from_cgroup_text("4:memory:/kubepods/phasewise/job-b\\n1:cpu,cpuacct:/\\n", "phasewise")
    'job-b'
    >>> container_from_cgroup_text("0::/user.slice\\n", "phasewise") is None
    True
    """
    want = [p for p in prefix.split("/") if p]
    n = len(want)
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        comps = [c for c in parts[2].split("/") if c]
        for i in range(len(comps) - n):
            if comps[i : i + n] == want:
                name = comps[i + n]
                if name and name[0].isalnum() and set(name) <= _NAME_OK:
                    return name
                break
    return None


def container_of_pid(pid: int, prefix: str, proc_root: str | os.PathLike = "/proc") -> str | None:
    """Managed container of *pid* via ``<proc_root>/<pid>/cgroup``; ``None`` if not managed or gone."""
    try:
        text = (Path(proc_root) / str(int(pid)) / "cgroup").read_text()
    except (OSError, ValueError):
        return None
    return container_from_cgroup_text(text, prefix)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlSampler:
    """Per-GPU and per-container GPU usage from NVML.

    Parameters
    ----------
    nvml
        Module object exposing the pynvml functions used here; ``None`` loads ``pynvml``.
    prefix
        Managed cgroup prefix, to map processes to containers.
    proc_root
        Where ``<pid>/cgroup`` files are read (``/proc``; a fixture tree in tests).
    layouts, parent
        The cgroup layouts containers are found in (:mod:`phasewise.kit.cgroups.layouts`) and
        where the runtimes' trees start; a process in a runtime's container is
        attributed to the container's id.
    """

    def __init__(self, nvml: Any = None, *, prefix: str = "phasewise", proc_root: str | os.PathLike = "/proc",
                 layouts: tuple[str, ...] = ("flat",), parent: str = "") -> None:
        self.prefix = prefix
        self.layouts = tuple(layouts)
        self.parent = parent
        self.proc_root = Path(proc_root)
        self.reason: str | None = None  # why NVML is unavailable, once known
        self._nvml = nvml
        self._started = False
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    @property
    def available(self) -> bool:
        return self._start()

    def _start(self) -> bool:
        if self._started:
            return True
        if self.reason is not None:
            return False
        try:
            if self._nvml is None:
                self._nvml = load_pynvml()
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
        except ImportError as e:
            return self._unavailable(f"pynvml not installed: {e}")
        except Exception as e:  # noqa: BLE001 - NVMLError subclasses, or a broken driver install
            return self._unavailable(f"{type(e).__name__}: {e}")
        if count == 0:
            self._shutdown()
            return self._unavailable("no devices")
        self._started = True
        log.info("NVML: %d GPU(s)", count)
        return True

    def _unavailable(self, reason: str) -> bool:
        self.reason = reason
        log.warning("no NVIDIA GPU: NVML unavailable (%s); GPU fields omitted", reason)
        return False

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            log.debug("nvmlShutdown failed: %s", e)

    def close(self) -> None:
        if self._started:
            self._started = False
            self._shutdown()

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    # ------------------------------------------------------------------ sampling

    def sample(self) -> GpuReading | None:
        """This tick's reading, or ``None`` when there is no usable GPU."""
        if not self._start():
            return None
        nv = self._nvml
        error = getattr(nv, "NVMLError", Exception)
        try:
            count = int(nv.nvmlDeviceGetCount())
        except error as e:
            self._warn_once("count", "NVML: cannot count GPUs (%s); GPU fields omitted this tick", e)
            return None
        gpus: list[GpuSample] = []
        util_pct: dict[str, float] = {}
        mem: dict[str, float] = {}
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                u = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                mi = nv.nvmlDeviceGetMemoryInfo(h)
            except error as e:
                self._warn_once(f"gpu{i}", "NVML: GPU %d unreadable (%s); skipped", i, e)
                continue
            u = min(max(u, 0.0), 100.0)
            gpus.append(GpuSample(index=i, uuid=uuid, util=u, mem_used_bytes=float(mi.used),
                                  mem_total_bytes=float(mi.total)))
            try:
                procs = list(nv.nvmlDeviceGetComputeRunningProcesses(h))
            except error as e:
                self._warn_once(f"procs{i}", "NVML: GPU %d process list unavailable (%s); no attribution", i, e)
                continue
            self._attribute(u, procs, util_pct, mem)
        return GpuReading(gpus=tuple(gpus), containers={c: (util_pct[c], mem[c]) for c in util_pct})

    def _container_of(self, pid: int) -> str | None:
        if self.layouts == ("flat",):
            return container_of_pid(pid, self.prefix, self.proc_root)
        try:
            text = (self.proc_root / str(int(pid)) / "cgroup").read_text()
        except (OSError, ValueError):
            return None
        if "flat" in self.layouts:
            c = container_from_cgroup_text(text, self.prefix)
            if c is not None:
                return c
        return classify_proc_cgroup(text, self.parent, self.prefix, [x for x in self.layouts if x != "flat"])

    def _attribute(self, util: float, procs: list[Any], util_pct: dict[str, float], mem: dict[str, float]) -> None:
        if not procs:
            return
        used = [getattr(p, "usedGpuMemory", None) for p in procs]
        known = [m for m in used if m is not None]
        total = float(sum(known))
        by_memory = total > 0
        for p, m in zip(procs, used):
            c = self._container_of(p.pid)
            if c is None:
                continue
            share = (float(m or 0) / total) if by_memory else 1.0 / len(procs)
            util_pct[c] = util_pct.get(c, 0.0) + util * share
            mem[c] = mem.get(c, 0.0) + float(m or 0)
