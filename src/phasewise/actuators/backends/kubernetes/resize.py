"""Kubernetes resize rules, pure: quantities, a pod's resize state, the patch a resize sends, when to recreate.

Functions of the pod as the API server returns it (a ``dict``), no IO:
:func:`plan_resize` builds the ``resize`` subresource's patch under VPA's
``InPlaceOrRecreate`` rules (QoS class kept, no restart, no memory limit
below the working set) or says why none is sent; :func:`recreate_reason` and
:func:`recreatable` decide the resize -> evict fallback. The rules and their
sources: docs/kubernetes.md, "Resizing: the rules" and "Resize -> evict
fallback".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = ["RecreatePolicy", "ResizePlan", "ResizeState", "format_cpu", "limits_of", "parse_quantity", "plan_resize",
           "recreatable", "recreate_reason", "resize_state"]

# --------------------------------------------------------------------------- quantities

_SUFFIX = {
    "": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QTY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def parse_quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity as a number (cores for CPU, bytes for memory).

    >>> parse_quantity("500m"), parse_quantity("2"), parse_quantity("256Mi"), parse_quantity("1e3")
    (0.5, 2.0, 268435456.0, 1000.0)
    """
    if isinstance(q, (int, float)) and not isinstance(q, bool):
        return float(q)
    m = _QTY.match(str(q).strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {q!r}")
    try:
        return float(Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""])
    except InvalidOperation as e:
        raise ValueError(f"not a Kubernetes quantity: {q!r}") from e


def format_cpu(cores: float) -> str:
    """Cores as millicores, rounded up (the API keeps CPU to the millicore).

    >>> format_cpu(1.5), format_cpu(0.0001), format_cpu(2.0)
    ('1500m', '1m', '2000m')
    """
    return f"{max(1, math.ceil(round(cores * 1000, 6)))}m"



# --------------------------------------------------------------------------- resize rules


@dataclass(frozen=True)
class ResizeState:
    """What the pod says about a resize: ``state`` in ``none | in-progress | deferred | infeasible | error``;
    ``since``: the condition's ``lastTransitionTime`` (Unix seconds; None: not given)."""

    state: str
    message: str = ""
    since: float | None = None


def _rfc3339(text: Any) -> float | None:
    """``2026-11-24T10:01:12Z`` as Unix seconds (None when absent or not a time).

    >>> _rfc3339("1970-01-01T00:01:00Z"), _rfc3339(None), _rfc3339("yesterday")
    (60.0, None, None)
    """
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def resize_state(pod: dict[str, Any]) -> ResizeState:
    """The resize state from the pod's conditions (1.33+) or ``status.resize`` (1.27-1.32).

    >>> resize_state({"status": {"conditions": [{"type": "PodResizePending", "status": "True",
    ...     "reason": "Infeasible", "message": "Node didn't have enough capacity"}]}}).state
    'infeasible'
    >>> resize_state({"status": {"resize": "InProgress"}}).state
    'in-progress'
    """
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") != "True":
            continue
        msg = str(c.get("message") or "")
        since = _rfc3339(c.get("lastTransitionTime"))
        if c.get("type") == "PodResizePending":
            reason = str(c.get("reason") or "")
            return ResizeState("infeasible" if reason == "Infeasible" else "deferred", msg, since)
        if c.get("type") == "PodResizeInProgress":
            return ResizeState("error" if c.get("reason") == "Error" else "in-progress", msg, since)
    legacy = {"InProgress": "in-progress", "Deferred": "deferred", "Infeasible": "infeasible",
              "Proposed": "in-progress"}.get(str(status.get("resize") or ""))
    return ResizeState(legacy or "none")


@dataclass(frozen=True)
class RecreatePolicy:
    """When ``in-place-or-recreate`` gives up on a pending resize (VPA's updater: 5 min, 1 h), and how
    often a watched resize is read again."""

    deferred_timeout_s: float = 300.0
    in_progress_timeout_s: float = 3600.0
    check_s: float = 30.0


def recreate_reason(state: ResizeState, pending_s: float | None, policy: RecreatePolicy) -> str | None:
    """Why ``in-place-or-recreate`` falls back to evicting the pod now (None: wait, or nothing pending).

    *pending_s*: how long the resize has been in *state* (None: unknown, so no timeout has passed).

    >>> p = RecreatePolicy()
    >>> recreate_reason(ResizeState("deferred", "no room"), 301.0, p)
    'the resize stayed Deferred for 301 s (more than 300 s): no room'
    >>> recreate_reason(ResizeState("deferred"), 299.0, p) is None, recreate_reason(ResizeState("none"), 1e9, p)
    (True, None)
    >>> recreate_reason(ResizeState("infeasible", "Node didn't have enough capacity"), None, p)
    "the node can never fit the resize (Infeasible): Node didn't have enough capacity"
    """
    msg = state.message or "no message"
    if state.state == "infeasible":
        return f"the node can never fit the resize (Infeasible): {msg}"
    if state.state == "error":
        return f"the kubelet reported an error applying the resize: {msg}"
    if pending_s is None:
        return None
    if state.state == "deferred" and pending_s > policy.deferred_timeout_s:
        return f"the resize stayed Deferred for {pending_s:.0f} s (more than {policy.deferred_timeout_s:g} s): {msg}"
    if state.state == "in-progress" and pending_s > policy.in_progress_timeout_s:
        return (f"the resize stayed in progress for {pending_s:.0f} s (more than {policy.in_progress_timeout_s:g} s)"
                f": {msg}")
    return None


def recreatable(pod: dict[str, Any]) -> tuple[str | None, str]:
    """``(why not, controller)``: why evicting *pod* would not recreate it elsewhere (None: it would), and
    its controller as ``Kind/name``.

    A pod without a controller owner is gone for good once evicted; a DaemonSet's pod comes back on the
    same node, which is what cannot fit it; a static (mirror) pod is owned by its Node.

    >>> recreatable({"metadata": {"ownerReferences": [{"kind": "ReplicaSet", "name": "t-1", "controller": True}]}})
    (None, 'ReplicaSet/t-1')
    >>> recreatable({"metadata": {}})[0]
    'the pod has no controller to recreate it'
    """
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    ctl = next((r for r in refs if isinstance(r, dict) and r.get("controller") is True), None)
    if ctl is None:
        return "the pod has no controller to recreate it", ""
    kind, name = str(ctl.get("kind") or ""), str(ctl.get("name") or "")
    if kind == "DaemonSet":
        return f"its controller DaemonSet/{name} recreates it on this same node", f"{kind}/{name}"
    if kind == "Node":
        return "it is a static pod (owned by its node): nothing recreates it elsewhere", f"{kind}/{name}"
    return None, f"{kind}/{name}"


@dataclass(frozen=True)
class ResizePlan:
    """The patch to send, or why none is sent (``refused``; ``temporary`` when a retry may help)."""

    patch: dict[str, Any] | None = None
    refused: str = ""
    temporary: bool = False
    cpu_cores: float | None = None
    mem_bytes: int | None = None


def _res(container: dict[str, Any], kind: str) -> dict[str, Any]:
    return dict((container.get("resources") or {}).get(kind) or {})


def _qos(pod: dict[str, Any]) -> str:
    q = (pod.get("status") or {}).get("qosClass")
    if q:
        return str(q)
    cs = (pod.get("spec") or {}).get("containers") or []
    if all(not _res(c, "requests") and not _res(c, "limits") for c in cs):
        return "BestEffort"
    if all(_guaranteed(_res(c, "requests"), _res(c, "limits")) for c in cs):
        return "Guaranteed"
    return "Burstable"


def _guaranteed(req: dict[str, Any], lim: dict[str, Any]) -> bool:
    for r in ("cpu", "memory"):
        if r not in lim:
            return False
        if parse_quantity(req.get(r, lim[r])) != parse_quantity(lim[r]):  # a missing request defaults to the limit
            return False
    return True


def plan_resize(pod: dict[str, Any], container: str, *, cpu_cores: float | None, mem_bytes: int | None,
                mem_usage: float | None = None) -> ResizePlan:
    """The ``resize`` patch setting *container*'s limits (docs/kubernetes.md, "Resizing: the rules").

    >>> pod = {"spec": {"containers": [{"name": "w", "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
    ...        "limits": {"cpu": "1", "memory": "1Gi"}}}]}, "status": {"qosClass": "Guaranteed"}}
    >>> plan_resize(pod, "w", cpu_cores=2.0, mem_bytes=None).patch
    {'spec': {'containers': [{'name': 'w', 'resources': {'requests': {'cpu': '2000m'}, 'limits': {'cpu': '2000m'}}}]}}
    """
    spec_cs = (pod.get("spec") or {}).get("containers") or []
    c = next((x for x in spec_cs if x.get("name") == container), None)
    if c is None:
        return ResizePlan(refused=f"pod has no container {container!r}")
    state = resize_state(pod)
    if state.state in ("in-progress", "error"):
        return ResizePlan(refused=f"a resize is in progress ({state.message or state.state}); not stacking another",
                          temporary=True)
    if state.state == "deferred":
        return ResizePlan(refused=f"the kubelet deferred the pending resize: {state.message or 'no message'}",
                          temporary=True)
    qos = _qos(pod)
    if qos == "BestEffort":
        return ResizePlan(refused="BestEffort pod: any request or limit would change its QoS class, "
                                  "which a resize may not")
    req, lim = _res(c, "requests"), _res(c, "limits")
    policies = {p.get("resourceName"): p.get("restartPolicy") for p in c.get("resizePolicy") or []}
    want: dict[str, tuple[str, float]] = {}
    notes: list[str] = []
    if cpu_cores is not None:
        want["cpu"] = (format_cpu(cpu_cores), parse_quantity(format_cpu(cpu_cores)))
    if mem_bytes is not None:
        want["memory"] = (str(int(mem_bytes)), float(int(mem_bytes)))
    new_req, new_lim = dict(req), dict(lim)
    for r, (text, value) in list(want.items()):
        if r not in lim:
            notes.append(f"{r}: no limit in the pod spec, none added")
            del want[r]
            continue
        cur = parse_quantity(lim[r])
        if value == cur:
            del want[r]
            continue
        if policies.get(r) == "RestartContainer":
            notes.append(f"{r}: resizePolicy RestartContainer (a resize would restart the container)")
            del want[r]
            continue
        if r == "memory" and value < cur and mem_usage is not None and value < mem_usage:
            notes.append(f"memory: {int(value)} bytes is below the working set {int(mem_usage)}; the kubelet "
                         "would leave the decrease in progress")
            del want[r]
            continue
        new_lim[r] = text
        if qos == "Guaranteed":
            new_req[r] = text
        elif r in req and parse_quantity(req[r]) > value:
            new_req[r] = text
    if state.state == "infeasible" and want:
        # a resize the node can never fit stays refused unless this one asks for less
        asked = {r: parse_quantity(req[r]) for r in want if r in req}
        if not any(parse_quantity(new_req[r]) < v for r, v in asked.items()):
            return ResizePlan(refused=f"the pending resize is Infeasible on this node: {state.message or 'no message'}")
    if not want:
        why = "; ".join(notes) if notes else "limits already in force"
        return ResizePlan(refused=why if notes else "", cpu_cores=cpu_cores, mem_bytes=mem_bytes)
    if qos == "Burstable":
        others = [x for x in spec_cs if x is not c]
        if _guaranteed(new_req, new_lim) and all(_guaranteed(_res(x, "requests"), _res(x, "limits")) for x in others):
            return ResizePlan(refused="the resize would make every request equal its limit, turning a Burstable "
                                      "pod Guaranteed (QoS class may not change)")
    resources: dict[str, Any] = {}
    changed_req = {r: new_req[r] for r in want if r in new_req and new_req[r] != req.get(r)}
    if changed_req:
        resources["requests"] = changed_req
    resources["limits"] = {r: new_lim[r] for r in want}
    patch = {"spec": {"containers": [{"name": container, "resources": resources}]}}
    cpu = parse_quantity(want["cpu"][0]) if "cpu" in want else None
    mem = int(want["memory"][1]) if "memory" in want else None
    return ResizePlan(patch=patch, cpu_cores=cpu, mem_bytes=mem, refused="; ".join(notes))



def limits_of(pod: Any, container: str) -> tuple[float | None, float | None]:
    """The container's limits in the pod the API server returned (the spec it accepted)."""
    for c in ((pod or {}).get("spec") or {}).get("containers") or []:
        if c.get("name") == container:
            lim = _res(c, "limits")
            cpu = parse_quantity(lim["cpu"]) if "cpu" in lim else None
            mem = parse_quantity(lim["memory"]) if "memory" in lim else None
            return cpu, mem
    return None, None
