"""The cgroup layouts containers live in and how a cgroup path names a container (pure, no IO).

:func:`classify` reads a path below a runtime's parent; docs/kubernetes.md ("Container layouts")
has the table of layouts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from phasewise.kit.records import LAYOUTS

__all__ = ["RUNTIME_LAYOUTS", "Match", "classify", "classify_proc_cgroup", "top_dirs"]

#: layouts a container runtime makes (everything but phasewise's own flat prefix)
RUNTIME_LAYOUTS = LAYOUTS[1:]

_ID = r"(?P<id>[0-9a-f]{64})"
_UID = r"(?P<uid>[0-9a-f][0-9a-f-]{7,63})"
_UID_ = r"(?P<uid>[0-9a-f][0-9a-f_]{7,63})"
_QOS = r"(?P<qos>besteffort|burstable)"
_SCOPE = r"(?P<rt>cri-containerd|crio|docker)-" + _ID + r"\.scope"

#: (layout, regex on the path relative to the runtime's parent; a container's sub-cgroups match too)
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kubepods-cgroupfs", re.compile(rf"^kubepods/(?:{_QOS}/)?pod{_UID}/{_ID}(?:/.*)?$")),
    ("kubepods-systemd", re.compile(
        rf"^kubepods\.slice/(?:kubepods-(?P<qos1>besteffort|burstable)\.slice/)?"
        rf"kubepods(?:-(?P<qos2>besteffort|burstable))?-pod{_UID_}\.slice/{_SCOPE}(?:/.*)?$")),
    ("docker-cgroupfs", re.compile(rf"^docker/{_ID}(?:/.*)?$")),
    ("docker-systemd", re.compile(rf"^system\.slice/docker-{_ID}\.scope(?:/.*)?$")),
)
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
#: the directory each runtime layout's containers are found under (relative to the parent)
_TOPS = {"kubepods-cgroupfs": "kubepods", "kubepods-systemd": "kubepods.slice", "docker-cgroupfs": "docker",
         "docker-systemd": "system.slice"}


@dataclass(frozen=True, slots=True)
class Match:
    """A container's cgroup, as its path says: the layout, the id and what the path tells of its pod."""

    layout: str
    container_id: str
    rel: str  #: the container's cgroup, relative to the runtime's parent (sub-cgroups cut off)
    pod_uid: str | None = None
    qos: str | None = None
    runtime: str | None = None


def top_dirs(layouts: Sequence[str]) -> dict[str, str]:
    """``{layout: directory its containers are under}`` for the runtime layouts among *layouts*."""
    return {lay: _TOPS[lay] for lay in layouts if lay in _TOPS}


def classify(rel: str, layouts: Sequence[str] = RUNTIME_LAYOUTS) -> Match | None:
    """The container whose cgroup *rel* (relative to the runtime's parent) is or is inside, or ``None``.

    >>> m = classify("kubepods/burstable/pod0d5a4c52-1f37-4a8e-b8a5-7c7f1f3a9d01/" + "ab" * 32)
    >>> m.layout, m.qos, m.pod_uid, m.container_id == "ab" * 32
    ('kubepods-cgroupfs', 'burstable', '0d5a4c52-1f37-4a8e-b8a5-7c7f1f3a9d01', True)
    >>> m = classify("kubepods.slice/kubepods-pod0d5a4c52_1f37.slice/cri-containerd-" + "cd" * 32 + ".scope")
    >>> m.layout, m.qos, m.pod_uid, m.runtime
    ('kubepods-systemd', 'guaranteed', '0d5a4c52-1f37', 'containerd')
    >>> classify("system.slice/crio-conmon-" + "cd" * 32 + ".scope") is None
    True
    """
    rel = rel.strip("/")
    for layout, pattern in _PATTERNS:
        if layout not in layouts:
            continue
        m = pattern.match(rel)
        if m is None:
            continue
        g = m.groupdict()
        cid = g["id"]
        cut = m.end("id") + (len(".scope") if layout.endswith("systemd") else 0)
        qos = None
        runtime = None
        uid = g.get("uid")
        if layout == "kubepods-cgroupfs":
            qos = g.get("qos") or "guaranteed"
        elif layout == "kubepods-systemd":
            q1, q2 = g.get("qos1"), g.get("qos2")
            if q1 != q2:  # kubepods-burstable.slice/kubepods-besteffort-pod...: not a kubelet path
                continue
            qos = q1 or "guaranteed"
            uid = uid.replace("_", "-") if uid else None
            runtime = _RUNTIMES[g["rt"]]
        else:
            runtime = "docker"
        return Match(layout, cid, rel[:cut], uid, qos, runtime)
    return None


def classify_proc_cgroup(text: str, parent: str = "", prefix: str = "phasewise",
                         layouts: Sequence[str] = LAYOUTS) -> str | None:
    """The container id a ``/proc/<pid>/cgroup`` file places the process in, or ``None``.

    Flat containers are named by the component after *prefix*; runtime
    layouts by their id, the path taken relative to *parent*.

    >>> classify_proc_cgroup("0::/system.slice/docker-" + "ef" * 32 + ".scope\\n") == "ef" * 32
    True
    >>> classify_proc_cgroup("4:memory:/phasewise/job-a/worker\\n1:cpu:/\\n")
    'job-a'
    >>> classify_proc_cgroup("0::/user.slice\\n") is None
    True
    """
    parent_parts = [p for p in parent.split("/") if p]
    want = [p for p in prefix.split("/") if p]
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        comps = [c for c in parts[2].split("/") if c]
        if "flat" in layouts and want and comps[: len(want)] == want and len(comps) > len(want):
            name = comps[len(want)]
            if _FLAT_NAME.fullmatch(name):
                return name
        if parent_parts:
            if comps[: len(parent_parts)] != parent_parts:
                continue
            comps = comps[len(parent_parts):]
        m = classify("/".join(comps), layouts)
        if m is not None:
            return m.container_id
    return None


#: a flat container's name (the rule of :func:`phasewise.kit.cgroups.fs.is_container_name`; fullmatch:
#: no trailing newline)
_FLAT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,200}")
