"""The Kubernetes backend: limits through the pod ``resize`` subresource, eviction, binding, scale, delete.

:class:`KubernetesBackend` carries out the actuator's commands through the
API server, so the pod spec shows the limits in force; the pure rules are in
:mod:`~phasewise.actuators.backends.kubernetes.resize`, the client in
:mod:`~phasewise.actuators.backends.kubernetes.api`. Requests, answers, the
resize -> evict fallback and what is advisory: docs/kubernetes.md, "The
Kubernetes backend".
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.actuators.backends.kubernetes.api import CONTAINER_ID, ApiError, KubeApi, PodContainer
from phasewise.actuators.backends.kubernetes.resize import (
    RecreatePolicy,
    ResizeState,
    limits_of,
    parse_quantity,
    plan_resize,
    recreatable,
    recreate_reason,
    resize_state,
)
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

__all__ = ["RECREATE", "KubernetesBackend", "weight_advisory"]

log = logging.getLogger(__name__)

_STRATEGIC = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"


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
    """Carries out commands through the API server (docs/kubernetes.md, "The Kubernetes backend")."""

    name = "kubernetes"

    def __init__(self, api: KubeApi, resolve: Callable[[str], PodContainer | None], *,
                 present: Callable[[str], bool] | None = None, recreate: RecreatePolicy | None = None,
                 clock: Callable[[], float] = time.time, max_watched: int = 10_000, node: str = "") -> None:
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
        #: this node (its pods are watched for their jobs' states: :meth:`watch_pods`)
        self.node = node or getattr(resolve, "node", "")
        #: the uids of the pods this backend deleted for a terminate decision (their end is ``terminated``)
        self.deleted: dict[str, float] = {}
        self._pod_watch: tuple[threading.Thread, threading.Event] | None = None

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

    def annotate(self, container: str, annotations: dict[str, str]) -> Outcome:
        """Set *annotations* on the pod holding *container* (a GPU share, for HAMi at the pod's next creation)."""
        try:
            pc = self._where(container)
            path = f"/api/v1/namespaces/{_q(pc.namespace)}/pods/{_q(pc.pod)}"
            self.api.request("PATCH", path, {"metadata": {"annotations": annotations}}, _STRATEGIC)
        except ApiError as e:
            return Outcome.failed(f"annotating the pod of {container!r}: {e}", temporary=e.temporary)
        return Outcome.applied(f"pod {pc.namespace}/{pc.pod} annotated")

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
        cpu, mem = limits_of(got, pc.container)
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
        m = CONTAINER_ID.search(cmd.container)
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
        self.deleted[uid] = self.clock()  # its end, when the pod watch sees it, was asked for
        if len(self.deleted) > self.max_watched:  # the oldest first
            del self.deleted[next(iter(self.deleted))]
        gmd = got.get("metadata") or {}
        how = (f"the kubelet sends SIGTERM, then SIGKILL after {grace} s" if grace else "SIGKILL at once")
        owner = next((o for o in md.get("ownerReferences") or [] if o.get("controller")), None)
        again = f"; its controller {owner.get('kind')}/{owner.get('name')} may start a new pod" if owner else ""
        since = f" (terminating since {gmd['deletionTimestamp']})" if gmd.get("deletionTimestamp") else ""
        return Outcome.applied(f"deleted pod {name} uid {uid}{since}: {how}{again}")

    # ------------------------------------------------------------------ the jobs' states (pod_watch.py)

    def watch_pods(self, on_state: Callable[[Any], Any], on_listed: Callable[[set[str]], Any]) -> bool:
        """Follow this node's pods on a thread of their own, each job pod's state to *on_state*
        (:class:`~phasewise.actuators.backends.kubernetes.pod_watch.PodWatch`); ``False`` without a node."""
        from phasewise.actuators.backends.kubernetes.pod_watch import PodWatch

        if not self.node or self._pod_watch is not None:
            return self._pod_watch is not None
        stop = threading.Event()
        w = PodWatch(self.api, self.node, on_state, on_listed)
        t = threading.Thread(target=w.run, args=(stop,), name="phasewise-pod-watch", daemon=True)
        t.start()
        self._pod_watch = (t, stop)
        return True

    def close(self) -> None:
        """Stop following the pods (the thread ends with its watch request, a daemon until then)."""
        if self._pod_watch is not None:
            self._pod_watch[1].set()
            self._pod_watch = None

    def _bind(self, cmd: Bind) -> Outcome:
        """Bind the pod to the node; with ``cmd.job``, only a pod that names that job (``phasewise.io/job``)
        and is not bound yet (one bound to this node already: done)."""
        if cmd.job:
            from phasewise.actuators.backends.kubernetes.pod_watch import JOB_KEY, job_of

            path = f"/api/v1/namespaces/{_q(cmd.namespace)}/pods/{_q(cmd.pod)}"
            try:
                pod = self.api.request("GET", path) or {}
            except ApiError as e:
                if e.status == 404:
                    return Outcome("rejected", f"pod {cmd.container} of job {cmd.job!r} does not exist: nothing "
                                               "to bind")
                raise
            named = job_of(pod)
            if named != cmd.job:
                return Outcome("rejected", f"pod {cmd.container} names job {named!r} ({JOB_KEY}), not "
                                           f"{cmd.job!r}: not bound")
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound == cmd.node:
                return Outcome.applied(f"pod {cmd.container} is bound to node {cmd.node} already")
            if bound:
                return Outcome("rejected", f"pod {cmd.container} of job {cmd.job!r} is bound to node {bound} "
                                           f"already, not {cmd.node}")
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
        ok = isinstance(n, int) and not isinstance(n, bool) and n >= 0
        return Outcome.applied(f"deployment {cmd.namespace}/{cmd.deployment} scaled to {n} replicas",
                               replicas=n if ok else cmd.replicas)


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
