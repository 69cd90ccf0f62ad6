"""The Kubernetes backend: limits through the pod ``resize`` subresource, eviction, binding, scale.

Where the cgroup backend writes a container's limits behind the kubelet's
back, this backend asks the API server, so the pod spec shows the limits in
force and the kubelet does not overwrite them:

==============  ==========================================================  ===========================
command         request                                                     answer
==============  ==========================================================  ===========================
``SetLimits``   ``PATCH /api/v1/namespaces/{ns}/pods/{pod}/resize``         200 + the Pod
                (strategic merge patch of the container's resources)
``Evict``       ``POST  /api/v1/namespaces/{ns}/pods/{pod}/eviction``       201 + a Status (429: a
                (a ``policy/v1`` Eviction)                                  disruption budget forbids)
``Terminate``   ``GET .../pods/{pod}``, then ``DELETE .../pods/{pod}``       200 + the Pod, terminating
                (``gracePeriodSeconds``, ``preconditions.uid``)             (409: another pod; 404: gone)
``Bind``        ``POST  /api/v1/namespaces/{ns}/pods/{pod}/binding``        201 + a Status (409: bound)
``Scale``       ``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{d}/scale``  200 + an autoscaling/v1 Scale
                (merge patch of ``spec.replicas``)
==============  ==========================================================  ===========================

Before a resize the backend reads the pod (``GET .../pods/{pod}``) and
follows the rules of VPA's ``InPlaceOrRecreate`` updater; its fallback to
recreating the pod is the workload's choice (below):

- a resize the kubelet is carrying out (condition ``PodResizeInProgress``)
  is not stacked on: temporary failure, retried later;
- ``PodResizePending`` with reason ``Deferred`` (fits the node later): temporary
  failure; with reason ``Infeasible`` (can never fit this node): permanent,
  unless the new request is smaller than the one found infeasible (a smaller
  resize replaces it). Before 1.33 the same states were ``status.resize``
  (``InProgress | Deferred | Infeasible``); both are read;
- the pod's QoS class is kept (the API server refuses a resize that changes
  it): a Guaranteed pod gets requests == limits; a Burstable pod gets the new
  limit and its request only when the request is above it (then equal to the
  limit, unless that would make every container's requests equal its limits,
  which would turn the pod Guaranteed: refused); a BestEffort pod is refused;
  a resource that has no limit in the spec is not given one;
- a container whose ``resizePolicy`` for the resource is ``RestartContainer``
  is not resized (it would restart the workload);
- a memory limit is never lowered below the container's working set (read
  from ``metrics.k8s.io``, the same number the kubelet compares): the kubelet
  of 1.34+ leaves such a decrease in progress with an error (KEP-1287,
  "Memory Limit Decreases"), and 1.33's API server refuses every memory-limit
  decrease of a ``NotRequired`` container with 422 (reported as permanent).
  The actuator's own floor (working set + margin) runs before this.

A ``SetCpuWeight`` is **advisory** here (``rejected``, with the weight it
stands for, :func:`weight_advisory`): the kubelet derives a container's
``cpu.shares`` from its CPU request (1024 per core; on cgroup v2 converted
to ``cpu.weight``) and the API has no weight. Resizing the request to carry a
weight would misuse it: the request is the scheduler's account of the node's
capacity (weight 3200, a priority-5 job, would be 32 cores requested: an
``Infeasible`` resize, or a node the scheduler thinks full), and a
Guaranteed pod's request cannot leave its limit. On Kubernetes the CPU among
running pods follows their requests; priorities act through admission and
preemption (a PriorityClass, or this actuator's ``Evict``).

A ``Terminate`` deletes the pod with ``gracePeriodSeconds`` = the grace: the
kubelet sends SIGTERM to its containers and SIGKILL after the grace, which is
the command's meaning. It is a delete, not an eviction: an eviction honours
PodDisruptionBudgets and answers 429 while one forbids it, so a job stopped
at its objective (or by a hard stop) would go on holding the resources the
stop frees; the job ending is its completion, not a disruption for a budget
to ration (``Evict`` stays the command of preemption). The pod is read
first: one already terminating is not deleted again, and the delete carries
the pod's ``uid`` as a precondition, so a pod recreated under the same name
(a StatefulSet's) is never the one deleted. A pod whose controller replaces
its pods (a ReplicaSet, a StatefulSet, a Job whose pod did not succeed)
comes back; the outcome names the controller. The kubelet always starts
with SIGTERM: a job that checkpoints through its control channel
(``sigterm=False``) should treat SIGTERM as checkpoint-and-exit on
Kubernetes.

**Resize -> evict fallback** (``SetLimits.update_mode``, the workload's
``phasewise.io/update-mode``). ``in-place`` (the default) never evicts for a
resize. ``in-place-or-recreate`` does what VPA's ``InPlaceOrRecreate`` does
(:func:`recreate_reason`): it evicts the pod, through the Eviction API (so
PodDisruptionBudgets hold), when the resize is ``Infeasible`` (unless the new
request is smaller, which is tried in place first), when the kubelet reports
an ``Error`` applying it, when it stays ``Deferred`` longer than
``deferred_timeout_s`` (5 min) or in progress longer than
``in_progress_timeout_s`` (1 h), counted from the condition's
``lastTransitionTime`` (else from when this backend sent the resize or first
saw it pending). A pod no controller recreates (no controller owner, a
DaemonSet's or a static pod) is never evicted (:func:`recreatable`). A
resize the API server accepted, or found pending, is watched: every
``check_s`` the backend reads the pod again (:meth:`KubernetesBackend.follow_up`)
until the resize is done, the pod is gone, or the fallback evicted it; an
eviction a disruption budget refuses (429) is tried again at the next check
(or after ``Retry-After``), never counted as a failure of the eviction.

HTTP answers map onto outcomes: 404 (pod gone), 403 (RBAC), 422 (invalid) and
400 are permanent; 409 (conflict), 429 (too many requests, or a disruption
budget), 5xx and transport errors are temporary. The message carries the API
server's ``Status.message``.

The client is the standard library's ``urllib`` (no dependency): six
requests, JSON bodies, the service account's bearer token re-read for every
request (bound tokens rotate) and its CA bundle for TLS. Containers are found
by the id in their managed name (the runtime's 64-hex id, as in
``cri-containerd-<id>.scope`` or ``docker-<id>.scope``) among the pods of this
node (``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>&resourceVersion=0``,
from the API server's cache, kept for ``ttl_s``, 10 s), or by an explicit
``namespace/pod/container`` resolver.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from phasewise.actuators.commands import (
    Bind,
    Command,
    Evict,
    Freeze,
    Outcome,
    Scale,
    SetCpuWeight,
    SetLimits,
    StartJob,
    Terminate,
    Thaw,
)

__all__ = [
    "ApiError",
    "KubeApi",
    "KubernetesBackend",
    "PodContainer",
    "PodDirectory",
    "RecreatePolicy",
    "ResizePlan",
    "format_cpu",
    "parse_quantity",
    "plan_resize",
    "recreatable",
    "recreate_reason",
    "resize_state",
    "weight_advisory",
]

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_STRATEGIC = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"
_TEMPORARY_STATUS = {409, 429, 500, 502, 503, 504}

# --------------------------------------------------------------------------- quantities (pure)

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


# --------------------------------------------------------------------------- resize rules (pure)


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
    """The ``resize`` patch setting *container*'s limits, under the rules in the module doc.

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


# --------------------------------------------------------------------------- HTTP client


class ApiError(Exception):
    """A failed API request: the HTTP status (0: no answer), the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if status else message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s

    @property
    def temporary(self) -> bool:
        return self.status == 0 or self.status in _TEMPORARY_STATUS


class KubeApi:
    """A small JSON client for the API server: bearer token, CA bundle, timeouts.

    *token_file* is re-read for every request (the kubelet rotates bound
    service-account tokens); *ca_file* verifies the server (``https`` only).
    """

    def __init__(self, base_url: str, *, token: str | None = None, token_file: str | Path | None = None,
                 ca_file: str | Path | None = None, timeout_s: float = 10.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"API server URL must be http(s)://host[:port], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._token, self._token_file = token, Path(token_file) if token_file else None
        self.timeout_s = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if u.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    @classmethod
    def in_cluster(cls, sa_dir: Path = SA_DIR, env: dict[str, str] | None = None, timeout_s: float = 10.0) -> KubeApi:
        """The API server as a pod sees it: ``KUBERNETES_SERVICE_HOST/PORT``, the service account's token and CA."""
        env = dict(os.environ) if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a cluster: KUBERNETES_SERVICE_HOST is not set")
        token, ca = sa_dir / "token", sa_dir / "ca.crt"
        for f in (token, ca):
            if not f.is_file():
                raise ValueError(f"not in a cluster: {f} is missing (is a service account mounted?)")
        netloc = f"[{host}]" if ":" in host else host
        return cls(f"https://{netloc}:{port}", token_file=token, ca_file=ca, timeout_s=timeout_s)

    def _bearer(self) -> str | None:
        if self._token_file is not None:
            return self._token_file.read_text().strip()
        return self._token

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """Send one request; the decoded JSON answer, or :class:`ApiError`."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            tok = self._bearer()
        except OSError as e:
            raise ApiError(0, "TokenUnreadable", f"cannot read the service account token: {e}") from e
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise _api_error(e.code, e.read(), e.headers.get("Retry-After")) from None
        except (urllib.error.URLError, OSError) as e:
            raise ApiError(0, "Unreachable", f"{method} {path}: {getattr(e, 'reason', e)}") from e
        try:
            return json.loads(raw) if raw else None
        except ValueError as e:
            raise ApiError(0, "BadAnswer", f"{method} {path}: answer is not JSON") from e


def _api_error(code: int, raw: bytes, retry_after: str | None) -> ApiError:
    reason, message = "", raw[:200].decode("utf-8", "replace")
    try:
        st = json.loads(raw)
        if isinstance(st, dict) and st.get("kind") == "Status":
            reason, message = str(st.get("reason") or ""), str(st.get("message") or "")
    except ValueError:
        pass
    try:
        ra = float(retry_after) if retry_after else None
    except ValueError:
        ra = None
    return ApiError(code, reason, message, ra)


# --------------------------------------------------------------------------- which pod holds a container


@dataclass(frozen=True)
class PodContainer:
    namespace: str
    pod: str
    container: str


_ID = re.compile(r"([0-9a-f]{64})")


class PodDirectory:
    """Finds the pod and container of a managed container name among this node's pods.

    The name holds the runtime's container id (``cri-containerd-<id>.scope``,
    ``crio-<id>.scope``, ``docker-<id>.scope``, ``<id>``), matched against
    ``status.containerStatuses[].containerID`` (``<runtime>://<id>``). The
    node's pod list is cached for *ttl_s*; a miss refreshes it when the list
    is older than *miss_refresh_s* (a new pod), so unknown names do not
    hammer the API server.
    """

    def __init__(self, api: KubeApi, node: str, *, ttl_s: float = 10.0, miss_refresh_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not node:
            raise ValueError("the node name is needed (set it from the downward API: spec.nodeName)")
        self.api, self.node, self.ttl_s, self._clock = api, node, ttl_s, clock
        self.miss_refresh_s = miss_refresh_s
        self._by_id: dict[str, PodContainer] = {}
        self._at = -math.inf

    def _refresh(self) -> None:
        sel = urllib.parse.quote(f"spec.nodeName={self.node}")
        # resourceVersion=0: served from the API server's watch cache, not a quorum read of etcd (every
        # node lists every few seconds)
        pods = self.api.request("GET", f"/api/v1/pods?fieldSelector={sel}&resourceVersion=0")
        by_id = {}
        for p in (pods or {}).get("items") or []:
            md = p.get("metadata") or {}
            st = p.get("status") or {}
            for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
                cid = str(cs.get("containerID") or "").partition("://")[2]
                if cid:
                    by_id[cid] = PodContainer(md.get("namespace", "default"), md.get("name", ""), cs.get("name", ""))
        self._by_id, self._at = by_id, self._clock()

    def __call__(self, managed_name: str) -> PodContainer | None:
        m = _ID.search(managed_name)
        if m is None:
            return None
        cid = m.group(1)
        age = self._clock() - self._at
        if age > self.ttl_s or (cid not in self._by_id and age > self.miss_refresh_s):
            self._refresh()
        return self._by_id.get(cid)


def path_resolver(managed_name: str) -> PodContainer | None:
    """``namespace/pod/container`` (or ``namespace.pod.container`` where a ``/`` is not allowed).

    >>> path_resolver("ml/trainer-0/worker")
    PodContainer(namespace='ml', pod='trainer-0', container='worker')
    """
    parts = managed_name.split("/") if "/" in managed_name else managed_name.split(".")
    return PodContainer(*parts) if len(parts) == 3 and all(parts) else None


# --------------------------------------------------------------------------- the backend


@dataclass
class _Watched:
    """A resize the backend keeps reading until it is done (``in-place-or-recreate`` only)."""

    cmd: SetLimits
    where: PodContainer
    sent: float | None  #: when this backend sent the resize (wall clock; None: found pending)
    seen: float  #: when this backend first saw it pending or sent it
    next_check: float


RECREATE = "in-place-or-recreate"


class KubernetesBackend:
    """Carries out commands through the API server (see the module doc)."""

    name = "kubernetes"

    def __init__(self, api: KubeApi, resolve: Callable[[str], PodContainer | None], *,
                 present: Callable[[str], bool] | None = None, recreate: RecreatePolicy | None = None,
                 clock: Callable[[], float] = time.time, max_watched: int = 10_000) -> None:
        """*present*: whether the container is on this node (the cgroup layout's ``exists``, which also
        discovers it, so the actuator's per-workload check sees its real identity); ``None``: any pod
        container the API server lists on this node. *recreate*: the fallback's timeouts; *clock*: wall
        time (compared with the pod conditions' ``lastTransitionTime``)."""
        self.api, self.resolve, self.present = api, resolve, present
        self.recreate = recreate or RecreatePolicy()
        self.clock = clock
        self.max_watched = max_watched
        #: resizes of ``in-place-or-recreate`` workloads not done yet, by managed container name
        self.watched: dict[str, _Watched] = {}
        #: called with each fallback's outcome (evicted, waiting, not_recreatable, failed): the actuator's metric
        self.on_fallback: Callable[[str], None] = lambda outcome: None

    # ------------------------------------------------------------------ protocol

    def exists(self, container: str) -> bool:
        if self.present is not None and not self.present(container):
            return False
        try:
            return self.resolve(container) is not None
        except ApiError as e:
            log.warning("cannot list this node's pods: %s", e)
            return False

    def memory_usage(self, container: str) -> float | None:
        """The container's working set from ``metrics.k8s.io`` (what the kubelet reports), ``None`` if unknown."""
        try:
            pc = self.resolve(container)
            if pc is None:
                return None
            m = self.api.request("GET", f"/apis/metrics.k8s.io/v1beta1/namespaces/{_q(pc.namespace)}"
                                        f"/pods/{_q(pc.pod)}")
            for c in (m or {}).get("containers") or []:
                if c.get("name") == pc.container:
                    return parse_quantity((c.get("usage") or {})["memory"])
        except (ApiError, KeyError, ValueError) as e:
            log.warning("no memory usage for %r: %s", container, e)
        return None

    def apply(self, command: Command) -> Outcome:
        try:
            if isinstance(command, SetLimits):
                return self._resize(command)
            if isinstance(command, Evict):
                return self._evict(command)
            if isinstance(command, Terminate):
                return self._terminate(command)
            if isinstance(command, Bind):
                return self._bind(command)
            if isinstance(command, Scale):
                return self._scale(command)
            if isinstance(command, (Freeze, Thaw)):
                return Outcome.failed(f"the kubernetes backend cannot {type(command).__name__.lower()}: the API "
                                      "has no freezer (use the cgroup backend on the node)")
            if isinstance(command, StartJob):
                return Outcome.failed("the kubernetes backend does not start processes: on Kubernetes a placed "
                                      "job is a pod that the scheduler binding places (Bind)")
            if isinstance(command, SetCpuWeight):
                return Outcome("rejected", weight_advisory(command.weight))
        except ApiError as e:
            return Outcome.failed(f"{type(command).__name__} on {command.container!r}: {e}", temporary=e.temporary)
        return Outcome.failed(f"unknown command {command!r}")

    # ------------------------------------------------------------------ commands

    def _where(self, container: str) -> PodContainer:
        pc = self.resolve(container)
        if pc is None:
            raise ApiError(404, "NotFound", f"no pod on this node holds container {container!r}")
        return pc

    def _resize(self, cmd: SetLimits) -> Outcome:
        pc = self._where(cmd.container)
        path = f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}"
        pod = self.api.request("GET", path)
        what = f"{pc.namespace}/{pc.pod}/{pc.container}"
        recreate = cmd.update_mode == RECREATE
        if not recreate:
            self.watched.pop(cmd.container, None)  # the workload went back to in-place
        state = resize_state(pod)
        usage = None
        if cmd.mem_bytes is not None:
            usage = self.memory_usage(cmd.container)
        plan = plan_resize(pod, pc.container, cpu_cores=cmd.cpu_cores, mem_bytes=cmd.mem_bytes, mem_usage=usage)
        if recreate and state.state != "none" and plan.patch is None:
            # a resize is pending and this one is not sent in its place (a smaller request replacing
            # an infeasible one is tried in place first)
            now = self.clock()
            w = self._watch(cmd, pc, None, now)
            why = recreate_reason(state, self._pending_s(state, w, now), self.recreate)
            if why is not None:
                return self._recreate(cmd.container, pc, pod, why, now)
            return Outcome.failed(f"resize of {what} refused: {plan.refused}; {self._waiting(state)}",
                                  temporary=False)
        if plan.patch is None:
            if plan.refused:
                return Outcome.failed(f"resize of {what} refused: {plan.refused}", temporary=plan.temporary)
            self.watched.pop(cmd.container, None)
            return Outcome.applied("limits already in force", cpu_cores=cmd.cpu_cores, mem_bytes=cmd.mem_bytes)
        got = self.api.request("PATCH", path + "/resize", plan.patch, _STRATEGIC)
        cpu, mem = _limits_of(got, pc.container)
        note = f" (not changed: {plan.refused})" if plan.refused else ""
        if recreate:
            now = self.clock()
            self.watched.pop(cmd.container, None)  # a new resize: its own timeouts
            self._watch(cmd, pc, now, now)
            note += (f"; watched (update-mode {RECREATE}): evicted if it turns out infeasible or stays pending "
                     f"past its timeout")
        return Outcome.applied(f"resize of {what} accepted; the kubelet applies it{note}",
                               cpu_cores=cpu if plan.cpu_cores is not None else None,
                               mem_bytes=int(mem) if plan.mem_bytes is not None and mem is not None else None)

    # ------------------------------------------------------------------ resize -> evict fallback

    def _watch(self, cmd: SetLimits, pc: PodContainer, sent: float | None, now: float) -> _Watched:
        w = self.watched.get(cmd.container)
        if w is None or w.where != pc:
            if len(self.watched) >= self.max_watched:  # the oldest first
                del self.watched[next(iter(self.watched))]
            w = _Watched(cmd, pc, sent, now, now + self.recreate.check_s)
            self.watched[cmd.container] = w
        else:
            w.cmd = cmd
        return w

    def _pending_s(self, state: ResizeState, w: _Watched, now: float) -> float:
        """How long the resize has been pending: from the condition's transition time, else from when this
        backend sent it, else from when it first saw it pending (VPA: its own last attempt)."""
        start = state.since if state.since is not None else (w.sent if w.sent is not None else w.seen)
        return max(0.0, now - start)

    def _waiting(self, state: ResizeState) -> str:
        limit = {"deferred": self.recreate.deferred_timeout_s,
                 "in-progress": self.recreate.in_progress_timeout_s}.get(state.state)
        when = f"after {limit:g} s {state.state}" if limit is not None else "when it fails"
        return f"watched (update-mode {RECREATE}): the pod is evicted {when}"

    def _recreate(self, container: str, pc: PodContainer, pod: dict[str, Any], why: str, now: float) -> Outcome:
        """Evict the pod for its controller to recreate it (``in-place-or-recreate``)."""
        what = f"{pc.namespace}/{pc.pod}/{pc.container}"
        no, ctl = recreatable(pod)
        if no is not None:
            self.watched.pop(container, None)
            self.on_fallback("not_recreatable")
            return Outcome.failed(f"resize of {what} not applied: {why}; not evicted ({RECREATE}): {no}")
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pc.pod, "namespace": pc.namespace}}
        try:
            self.api.request("POST", f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}/eviction", body)
        except ApiError as e:
            if e.status == 429:  # a disruption budget (or the API's rate limit): try again later
                w = self.watched.get(container)
                if w is not None:
                    w.next_check = now + max(self.recreate.check_s, e.retry_after_s or 0.0)
                self.on_fallback("waiting")
                return Outcome.failed(f"resize of {what} not applied: {why}; eviction ({RECREATE}) not allowed yet "
                                      f"({e}): tried again every {self.recreate.check_s:g} s while the resize "
                                      "stays pending")
            self.watched.pop(container, None)
            self.on_fallback("failed")
            return Outcome.failed(f"resize of {what} not applied: {why}; eviction ({RECREATE}) failed: {e}",
                                  temporary=e.temporary)
        self.watched.pop(container, None)
        self.on_fallback("evicted")
        return Outcome.failed(f"resize of {what} not applied: {why}; pod {pc.namespace}/{pc.pod} evicted ({RECREATE}): "
                              f"{ctl} recreates it with its template's resources")

    def follow_up(self, now: float | None = None) -> list[tuple[str, Outcome]]:
        """Read every watched resize due a check; ``(container, outcome)`` of each that ended in an eviction
        or could not be carried out (a resize that completed, or a pod gone, is dropped silently)."""
        now = self.clock() if now is None else now
        out: list[tuple[str, Outcome]] = []
        for container, w in list(self.watched.items()):
            if w.next_check > now:
                continue
            w.next_check = now + self.recreate.check_s
            pc = w.where
            try:
                pod = self.api.request("GET", f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}")
            except ApiError as e:
                if e.status == 404:  # the pod is gone (deleted, evicted by someone else): nothing to watch
                    self.watched.pop(container, None)
                else:
                    log.warning("cannot read pod %s/%s of a watched resize: %s", pc.namespace, pc.pod, e)
                continue
            state = resize_state(pod)
            if state.state == "none":
                self.watched.pop(container, None)
                log.info("resize of %s/%s/%s done", pc.namespace, pc.pod, pc.container)
                continue
            why = recreate_reason(state, self._pending_s(state, w, now), self.recreate)
            if why is None:
                continue
            got = self._recreate(container, pc, pod, why, now)
            if container in self.watched:  # the eviction waits on a disruption budget: no outcome yet
                log.info("%s", got.message)
                continue
            out.append((container, got))
        return out

    def _evict(self, cmd: Evict) -> Outcome:
        pc = self._where(cmd.container)
        body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction",
                                "metadata": {"name": pc.pod, "namespace": pc.namespace}}
        if cmd.grace_period_s is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": int(cmd.grace_period_s)}
        self.api.request("POST", f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}/eviction", body)
        return Outcome.applied(f"evicted pod {pc.namespace}/{pc.pod}")

    def _terminate(self, cmd: Terminate) -> Outcome:
        pc = self._where(cmd.container)
        path = f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}"
        name = f"{pc.namespace}/{pc.pod}"
        try:
            return self._delete_pod(cmd, path, name)
        except ApiError as e:
            if e.status == 404:  # what the stop was for
                return Outcome.applied(f"pod {name} is gone already: nothing to stop ({e.message})")
            if e.status == 409 and "precondition" in e.message.lower():  # another pod under the name now
                return Outcome.failed(f"pod {name} was not deleted: it is not the pod that held the container "
                                      f"any more ({e.message})")
            raise

    def _delete_pod(self, cmd: Terminate, path: str, name: str) -> Outcome:
        pod = self.api.request("GET", path) or {}
        md = pod.get("metadata") or {}
        m = _ID.search(cmd.container)
        st = pod.get("status") or {}
        ids = [str(cs.get("containerID") or "") for cs in (st.get("containerStatuses") or [])]
        if m is not None and not any(i.endswith(m.group(1)) for i in ids):
            return Outcome.failed(f"pod {name} does not hold container {m.group(1)[:12]} any more (a new pod under "
                                  "the name?): not deleted")
        if md.get("deletionTimestamp"):
            return Outcome.applied(f"pod {name} is already terminating (since {md['deletionTimestamp']}, grace "
                                   f"{md.get('deletionGracePeriodSeconds')} s): not deleted again")
        uid = md.get("uid")
        if not uid:
            return Outcome.failed(f"pod {name} has no metadata.uid: not deleted without the precondition")
        grace = max(0, math.ceil(cmd.grace_s))
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace,
                "preconditions": {"uid": uid}}
        got = self.api.request("DELETE", path, body) or {}
        gmd = got.get("metadata") or {}
        how = (f"the kubelet sends SIGTERM, then SIGKILL after {grace} s" if grace else "SIGKILL at once")
        owner = next((o for o in md.get("ownerReferences") or [] if o.get("controller")), None)
        again = f"; its controller {owner.get('kind')}/{owner.get('name')} may start a new pod" if owner else ""
        since = f" (terminating since {gmd['deletionTimestamp']})" if gmd.get("deletionTimestamp") else ""
        return Outcome.applied(f"deleted pod {name} uid {uid}{since}: {how}{again}")

    def _bind(self, cmd: Bind) -> Outcome:
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": cmd.pod, "namespace": cmd.namespace},
                "target": {"apiVersion": "v1", "kind": "Node", "name": cmd.node}}
        self.api.request("POST", f"/api/v1/namespaces/{_q(cmd.namespace)}/pods/{_q(cmd.pod)}/binding", body)
        return Outcome.applied(f"bound pod {cmd.namespace}/{cmd.pod} to node {cmd.node}")

    def _scale(self, cmd: Scale) -> Outcome:
        if cmd.replicas < 0:
            return Outcome.failed(f"replicas must be >= 0, got {cmd.replicas}")
        got = self.api.request("PATCH", f"/apis/apps/v1/namespaces/{_q(cmd.namespace)}/deployments/"
                                        f"{_q(cmd.deployment)}/scale", {"spec": {"replicas": int(cmd.replicas)}},
                               _MERGE)
        n = ((got or {}).get("spec") or {}).get("replicas")
        return Outcome.applied(f"deployment {cmd.namespace}/{cmd.deployment} scaled to {n} replicas")


def weight_advisory(weight: int) -> str:
    """Why a CPU weight is not set through the API, and the request it would take.

    >>> weight_advisory(3200)[:60]
    'advisory, not applied: the kubelet sets cpu.shares from the '
    """
    cores = weight / 100  # weight 100 = 1024 shares = one core's request
    return (f"advisory, not applied: the kubelet sets cpu.shares from the container's CPU request (1024 per "
            f"core) and the API sets no weight; weight {weight} would be a request of {cores:g} cores, which "
            f"the scheduler counts as capacity, so the request is not resized for it")


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def _limits_of(pod: Any, container: str) -> tuple[float | None, float | None]:
    """The container's limits in the pod the API server returned (the spec it accepted)."""
    for c in ((pod or {}).get("spec") or {}).get("containers") or []:
        if c.get("name") == container:
            lim = _res(c, "limits")
            cpu = parse_quantity(lim["cpu"]) if "cpu" in lim else None
            mem = parse_quantity(lim["memory"]) if "memory" in lim else None
            return cpu, mem
    return None, None
