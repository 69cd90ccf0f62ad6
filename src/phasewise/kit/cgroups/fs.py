"""Where containers' cgroup files are, on cgroup v1 and v2, in every layout (:class:`CgroupLayout`).

The host agent reads and the actuator writes through it, resolving a container id to its cgroup with
the same discovery, so nothing but a discovered container (or a name under the flat prefix) is ever
returned (docs/kubernetes.md, "Container layouts").
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from phasewise.kit.cgroups.layouts import Match, classify, top_dirs
from phasewise.kit.records import LAYOUTS, ContainerIdentity
from phasewise.kit.settings import CGROUP_LAYOUTS, relative_cgroup_path

__all__ = ["CgroupLayout", "CgroupError", "Found", "detect_version", "is_container_name",
           "V1_CONTROLLERS"]

#: how deep below a runtime layout's top directory its containers are (kubepods.slice/qos/pod/scope)
_MAX_DEPTH = 3

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


@dataclass(frozen=True, slots=True)
class Found:
    """A discovered container: its cgroup relative to each hierarchy's root, and what its path says."""

    rel: str
    match: Match

    def identity(self) -> ContainerIdentity:
        m = self.match
        return ContainerIdentity(layout=m.layout, container_id=m.container_id, pod_uid=m.pod_uid, qos=m.qos,
                                 runtime=m.runtime)


@dataclass(frozen=True)
class CgroupLayout:
    root: Path
    prefix: str = "phasewise"
    version: int = 0  # 0 = detect
    #: ``flat`` (containers directly under the prefix), one runtime layout, or ``auto`` (all of them)
    layout: str = "flat"
    #: where the runtimes' trees start in each hierarchy (kubelet --cgroup-root); "" = the root
    parent: str = ""
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        if self.layout not in CGROUP_LAYOUTS:
            raise CgroupError(f"cgroup layout must be one of {', '.join(CGROUP_LAYOUTS)}, got {self.layout!r}")
        if self.parent:
            try:
                relative_cgroup_path(self.parent)
            except ValueError as e:
                raise CgroupError(f"invalid cgroup parent: {e}") from None

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts searched (``auto``: every one)."""
        return LAYOUTS if self.layout == "auto" else (self.layout,)

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
        """Directory of *container* for *controller* (v2 ignores the controller).

        Flat: the name under the prefix (whether or not it exists). Runtime
        layouts: the discovered container's cgroup (discovering again when
        the id is not known yet); an id not found raises :class:`CgroupError`.
        """
        name = self.check_name(container)
        if self.layout == "flat":
            return self.base(controller) / name
        found = self.find(name)
        if found is not None:
            return self.controller_root(controller) / found.rel
        if "flat" in self.layouts:
            return self.base(controller) / name
        raise CgroupError(f"container {name!r} not found in the {self.layout} layout under {self.root}")

    def find(self, container: str) -> Found | None:
        """The discovered container *container* (discovering again if unknown or gone)."""
        found = self._index.get(container)
        if found is not None and self._is_dir(found.rel):
            return found
        return self.discover().get(container)

    def identity(self, container: str) -> ContainerIdentity:
        """What the container's cgroup path says of it (flat: its name)."""
        found = self._index.get(container)
        if found is not None:
            return found.identity()
        return ContainerIdentity(layout="flat", container_id=container)

    def _is_dir(self, rel: str) -> bool:
        try:
            return (self.controller_root("memory" if self.version == 1 else "cpu") / rel).is_dir()
        except CgroupError:
            return False

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
        if self.layout == "flat":
            return sorted(self._flat_names())
        return sorted(self.discover())

    def _flat_names(self) -> set[str]:
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
            except (FileNotFoundError, NotADirectoryError):
                continue
        return names

    def discover(self) -> dict[str, Found]:
        """Every container of the searched layouts present now, by id (and remember where each is)."""
        out: dict[str, Found] = {}
        if "flat" in self.layouts:
            for name in self._flat_names():
                out[name] = Found(f"{self.prefix}/{name}", Match("flat", name, name))
        ctrls = ("cpuacct", "memory") if self.version == 1 else ("unified",)
        tops = top_dirs(self.layouts)
        for c in ctrls:
            try:
                base = self.controller_root(c) / self.parent if self.parent else self.controller_root(c)
            except CgroupError:
                continue
            for layout, top in tops.items():
                self._walk(base, top, 0, (layout,), out)
        self._index.clear()
        self._index.update(out)
        return out

    def _walk(self, base: Path, rel: str, depth: int, layouts: tuple[str, ...], out: dict[str, Found]) -> None:
        try:
            entries = [e.name for e in os.scandir(base / rel) if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return
        for name in entries:
            sub = f"{rel}/{name}"
            m = classify(sub, layouts)
            if m is not None:
                if m.rel == sub and m.container_id not in out:
                    full = f"{self.parent}/{sub}" if self.parent else sub
                    out[m.container_id] = Found(full, m)
            elif depth + 1 < _MAX_DEPTH:
                self._walk(base, sub, depth + 1, layouts, out)

    def exists(self, container: str) -> bool:
        if self.layout == "flat":
            c = "memory" if self.version == 1 else "cpu"
            return self.path(container, c).is_dir()
        if not is_container_name(container):
            return False
        if self.find(container) is not None:
            return True
        return "flat" in self.layouts and (self.base("memory" if self.version == 1 else "cpu") / container).is_dir()

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
