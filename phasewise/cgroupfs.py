"""Where managed containers' cgroup files live, for cgroup v1 and v2.

A *managed container* is a cgroup directly under ``<root>/<prefix>/`` (v2) or
``<root>/<controller>/<prefix>/`` (v1). Its id on the wire is its name
relative to the prefix (``job-a``). The root is a parameter so tests and
unusual hosts (the cgroup2 tree at ``/sys/fs/cgroup/unified`` on a hybrid
host, a container runtime's own parent such as ``kubepods``) point elsewhere.

Only the layout lives here; the sampler reads and the actuator writes through
it. Nothing outside the managed prefix is ever returned, so an actuator
cannot be talked into touching another cgroup.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from phasewise.settings import relative_cgroup_path

__all__ = ["CgroupLayout", "CgroupError", "detect_version", "is_container_name", "V1_CONTROLLERS"]

#: v1 controllers phasewise uses; each may be mounted alone or co-mounted
#: ("cpu,cpuacct"), which :meth:`CgroupLayout.controller_root` resolves.
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "freezer")

#: a managed container's name: 1-201 characters, an ASCII letter or digit first, then ASCII letters,
#: digits and ``_ . : @ -``; the whole text must match (no "/", no "..", no whitespace, no trailing
#: newline: ``$`` alone would let ``"job-0\n"`` through)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,200}")


def is_container_name(name: object) -> bool:
    """Whether *name* is a managed container's name (the one check every backend and the safety rules use).

    >>> [is_container_name(n) for n in ("job-0", "job-0\\n", "a/b", "..", ".x", "gpu:0@n1", "")]
    [True, False, False, False, False, True, False]
    """
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class CgroupError(OSError):
    """A cgroup operation failed; ``temporary`` says whether a retry may help."""

    def __init__(self, msg: str, *, temporary: bool = False) -> None:
        super().__init__(msg)
        self.temporary = temporary


def detect_version(root: str | os.PathLike) -> int:
    """1 if *root* holds v1 controller hierarchies, 2 if it is a cgroup2 mount."""
    r = Path(root)
    if (r / "cgroup.controllers").exists():
        return 2
    if any((r / c).is_dir() for c in ("cpu", "cpuacct", "memory", "cpu,cpuacct")):
        return 1
    raise CgroupError(f"{r} is neither a cgroup v2 mount nor a directory of v1 hierarchies")


@dataclass(frozen=True)
class CgroupLayout:
    root: Path
    prefix: str = "phasewise"
    version: int = 0  # 0 = detect

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        if not self.version:
            object.__setattr__(self, "version", detect_version(self.root))
        if self.version not in (1, 2):
            raise CgroupError(f"cgroup version must be 1 or 2, got {self.version}")
        try:
            relative_cgroup_path(self.prefix)  # the rule of the cgroup_prefix setting
        except ValueError as e:
            raise CgroupError(f"invalid managed prefix: {e}") from None

    # ------------------------------------------------------------------ paths

    def controller_root(self, controller: str) -> Path:
        """v1: the hierarchy holding *controller*; v2: the unified root."""
        if self.version == 2:
            return self.root
        direct = self.root / controller
        if direct.is_dir():
            return direct
        for d in self.root.iterdir() if self.root.is_dir() else ():
            if d.is_dir() and controller in d.name.split(","):
                return d
        raise CgroupError(f"cgroup v1 controller {controller!r} is not mounted under {self.root}")

    def base(self, controller: str = "cpu") -> Path:
        return self.controller_root(controller) / self.prefix

    def check_name(self, container: str) -> str:
        if not is_container_name(container):
            raise CgroupError(f"container id {container!r} is not a managed container name")
        return container

    def path(self, container: str, controller: str = "cpu") -> Path:
        """Directory of *container* for *controller* (v2 ignores the controller)."""
        return self.base(controller) / self.check_name(container)

    def controllers(self) -> tuple[str, ...]:
        if self.version == 2:
            return ("unified",)
        out = []
        for c in V1_CONTROLLERS:
            try:
                self.controller_root(c)
                out.append(c)
            except CgroupError:
                pass
        return tuple(out)

    # ------------------------------------------------------------------ discovery

    def containers(self) -> list[str]:
        """Managed containers present now (sorted)."""
        names: set[str] = set()
        ctrls = ("cpuacct", "memory") if self.version == 1 else ("unified",)
        for c in ctrls:
            try:
                base = self.base(c)
            except CgroupError:
                continue
            try:
                for d in base.iterdir():
                    if d.is_dir() and is_container_name(d.name):
                        names.add(d.name)
            except FileNotFoundError:
                continue
        return sorted(names)

    def exists(self, container: str) -> bool:
        c = "memory" if self.version == 1 else "cpu"
        return self.path(container, c).is_dir()

    # ------------------------------------------------------------------ lifecycle (demo, tests)

    def create(self, container: str) -> None:
        """Create the container's cgroup in every controller phasewise uses."""
        if self.version == 2:
            self._enable_v2_controllers()
            self.path(container).mkdir(parents=True, exist_ok=True)
            return
        for c in self.controllers():
            self.path(container, c).mkdir(parents=True, exist_ok=True)

    def _enable_v2_controllers(self) -> None:
        want = {"cpu", "memory"}
        parent = self.root
        for part in self.prefix.split("/"):
            avail = set((parent / "cgroup.controllers").read_text().split())
            missing = want - avail
            if missing:
                raise CgroupError(f"cgroup v2 controllers {sorted(missing)} not available at {parent}")
            sub = parent / "cgroup.subtree_control"
            enabled = set(sub.read_text().split())
            for c in sorted(want - enabled):
                try:
                    sub.write_text(f"+{c}")
                except OSError as e:
                    raise CgroupError(f"cannot enable {c} in {sub}: {e}") from e
            parent = parent / part
            parent.mkdir(exist_ok=True)
        sub = parent / "cgroup.subtree_control"
        enabled = set(sub.read_text().split())
        for c in sorted(want - enabled):
            sub.write_text(f"+{c}")

    def attach(self, container: str, pid: int) -> None:
        """Move *pid* into the container's cgroup(s)."""
        targets = [self.path(container)] if self.version == 2 else [self.path(container, c) for c in self.controllers()]
        for d in targets:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self, container: str) -> list[int]:
        c = "memory" if self.version == 1 else "cpu"
        try:
            text = (self.path(container, c) / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def remove(self, container: str, timeout_s: float = 5.0) -> None:
        """Remove the container's cgroup(s); its processes must have exited."""
        dirs = [self.path(container)] if self.version == 2 else [self.path(container, c) for c in self.controllers()]
        for d in dirs:
            deadline = time.monotonic() + timeout_s
            while d.exists():
                try:
                    d.rmdir()
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        break
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove {d}: {e}", temporary=e.errno == errno.EBUSY) from e
                    time.sleep(0.05)
