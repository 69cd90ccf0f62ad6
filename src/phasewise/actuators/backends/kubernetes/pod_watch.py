"""The job states of this node's pods, from a watch on the API server (``watch=true``, one stream).

:func:`pod_job_state` reads one pod (pure): a pod that names its job
(``phasewise.io/job``, annotation or label) is ``started`` once Running,
``finished`` once Succeeded, ``failed`` once Failed (a container terminated
``OOMKilled`` is an OOM kill; its exit code, signal and reason are kept), and a
pod deleted before it ended is ``failed`` (``terminated`` where this actuator
deleted it for a terminate decision). :class:`PodWatch` lists the node's pods,
then follows the watch from the list's ``resourceVersion`` (bookmarks keep it
current; ``410 Gone`` lists again). docs/kubernetes.md, "Job states from the
pod watch".
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from phasewise.actuators.backends.job_watch import signal_name
from phasewise.actuators.backends.kubernetes.api import ApiError, KubeApi

__all__ = ["JOB_KEY", "PodJobState", "PodWatch", "pod_job_state"]

log = logging.getLogger(__name__)

#: the annotation (or label) that names the job a pod runs
JOB_KEY = "phasewise.io/job"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,200}$")


@dataclass(frozen=True, slots=True)
class PodJobState:
    """A job pod's state as the API server shows it (``container`` is ``namespace/name``)."""

    job: str
    container: str
    uid: str
    kind: str  #: started, finished, failed, gone (deleted before it ended)
    exit_code: int | None = None
    signal: str | None = None
    oom: bool = False
    reason: str | None = None
    started: float | None = None  #: when it started running (wall clock, s)
    ended: float | None = None  #: when it ended (its last container's finishedAt), if known

    @property
    def run_s(self) -> float | None:
        if self.started is None or self.ended is None:
            return None
        return max(0.0, self.ended - self.started)


def _time(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def job_of(pod: dict[str, Any]) -> str | None:
    """The job a pod names (``phasewise.io/job`` annotation, else label), if it is a valid job id."""
    md = pod.get("metadata") or {}
    for where in (md.get("annotations") or {}, md.get("labels") or {}):
        job = where.get(JOB_KEY)
        if isinstance(job, str) and _JOB_ID.match(job):
            return job
    return None


def pod_job_state(pod: dict[str, Any], *, deleted: bool = False) -> PodJobState | None:
    """The job state *pod* shows (``None``: not a job pod, or nothing to report yet: Pending).

    *deleted*: the pod came in a ``DELETED`` watch event (or is gone from a list): one that had not
    ended is ``gone``.

    >>> pod = {"metadata": {"name": "p", "namespace": "ml", "uid": "u1", "annotations": {JOB_KEY: "j1"}},
    ...        "status": {"phase": "Failed", "containerStatuses": [{"name": "main", "state": {"terminated": {
    ...            "exitCode": 137, "reason": "OOMKilled", "startedAt": "2026-11-27T10:00:00Z",
    ...            "finishedAt": "2026-11-27T10:01:30Z"}}}]}}
    >>> s = pod_job_state(pod)
    >>> (s.kind, s.exit_code, s.signal, s.oom, s.run_s, s.reason)
    ('failed', 137, 'SIGKILL', True, 90.0, 'container main: OOMKilled (exit code 137)')
    """
    job = job_of(pod)
    if job is None:
        return None
    md, st = pod.get("metadata") or {}, pod.get("status") or {}
    where = f"{md.get('namespace', 'default')}/{md.get('name', '')}"
    uid = str(md.get("uid") or "")
    phase = st.get("phase")
    statuses = [cs for cs in (st.get("containerStatuses") or []) if isinstance(cs, dict)]
    states = [(cs.get("name", "?"), (cs.get("state") or {})) for cs in statuses]
    running = [s["running"] for _, s in states if isinstance(s.get("running"), dict)]
    ended = [(name, s["terminated"]) for name, s in states if isinstance(s.get("terminated"), dict)]
    starts = [t for t in (_time(r.get("startedAt")) for r in running) if t is not None]
    starts += [t for t in (_time(term.get("startedAt")) for _, term in ended) if t is not None]
    started = min(starts) if starts else _time(st.get("startTime"))
    finishes = [t for t in (_time(term.get("finishedAt")) for _, term in ended) if t is not None]
    finished = max(finishes) if finishes else None
    base = dict(job=job, container=where, uid=uid, started=started, ended=finished)
    if phase == "Succeeded":
        return PodJobState(kind="finished", exit_code=0, **base)
    if phase == "Failed":
        # the container that says why: an OOM kill first, then a non-zero exit, then any
        pick = next((e for e in ended if e[1].get("reason") == "OOMKilled"), None) or next(
            (e for e in ended if e[1].get("exitCode") not in (0, None)), None) or (ended[0] if ended else None)
        if pick is None:  # no container ended (evicted, node lost...): the pod's own reason
            why = ": ".join(str(x) for x in (st.get("reason"), st.get("message")) if x) or "pod failed"
            return PodJobState(kind="failed", reason=why[:1024], **base)
        name, term = pick
        code = term.get("exitCode")
        code = code if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255 else None
        sig = term.get("signal")
        signame = (signal_name(sig) if isinstance(sig, int) and sig > 0
                   else signal_name(code - 128) if code is not None and 128 < code <= 128 + 64 else None)
        reason = term.get("reason") or "Error"
        msg = f"container {name}: {reason}" + (f" (exit code {code})" if code is not None else "")
        if term.get("message"):
            msg += f": {term['message']}"
        if st.get("reason"):
            msg += f"; pod {st['reason']}"
        return PodJobState(kind="failed", exit_code=code, signal=signame, oom=reason == "OOMKilled",
                           reason=msg[:1024], **base)
    if deleted:
        return PodJobState(kind="gone", reason=f"pod {where} was deleted before it ended (phase {phase})", **base)
    if phase == "Running" and running:
        return PodJobState(kind="started", **base)
    return None


class PodWatch:
    """Lists this node's pods, then follows their watch; each job pod's state goes to *on_state*.

    *on_listed* gets the ``namespace/name`` of every job pod a list returned (pods gone meanwhile
    ended while nothing watched them). Single-threaded: :meth:`run` loops on a thread of its own.
    """

    def __init__(self, api: KubeApi, node: str, on_state: Callable[[PodJobState], Any],
                 on_listed: Callable[[set[str]], Any] = lambda present: None, *, timeout_s: int = 300) -> None:
        if not node:
            raise ValueError("the node name is needed to watch its pods")
        self.api, self.node = api, node
        self.on_state, self.on_listed = on_state, on_listed
        self.timeout_s = timeout_s
        self._selector = urllib.parse.quote(f"spec.nodeName={node}")

    def sync(self) -> str:
        """List the node's pods (a quorum read: the state now); report each job pod; its resourceVersion."""
        pods = self.api.request("GET", f"/api/v1/pods?fieldSelector={self._selector}") or {}
        present = set()
        for pod in pods.get("items") or []:
            s = pod_job_state(pod)
            if job_of(pod) is not None:
                md = pod.get("metadata") or {}
                present.add(f"{md.get('namespace', 'default')}/{md.get('name', '')}")
            if s is not None:
                self.on_state(s)
        self.on_listed(present)
        return str((pods.get("metadata") or {}).get("resourceVersion") or "")

    def follow(self, rv: str) -> str | None:
        """One watch request from *rv* until the server ends it; the last resourceVersion seen, or
        ``None`` when the server says it is too old (``410 Gone``: list again)."""
        q = (f"/api/v1/pods?fieldSelector={self._selector}&watch=true&allowWatchBookmarks=true"
             f"&timeoutSeconds={self.timeout_s}&resourceVersion={urllib.parse.quote(rv)}")
        try:
            for ev in self.api.stream(q, read_timeout_s=self.timeout_s + 30):
                rv2 = self.handle(ev)
                if rv2 is None:
                    return None
                if rv2:
                    rv = rv2
        except ApiError as e:
            if e.status == 410:
                return None
            raise
        return rv

    def handle(self, ev: Any) -> str | None:
        """One watch event; the resourceVersion it carries ("" if none), ``None`` for ``410 Gone``."""
        if not isinstance(ev, dict):
            return ""
        kind, obj = ev.get("type"), ev.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, dict) else None
            if code == 410:
                return None
            raise ApiError(int(code or 0), str(obj.get("reason") or ""), str(obj.get("message") or "watch error"))
        if not isinstance(obj, dict):
            return ""
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            s = pod_job_state(obj, deleted=kind == "DELETED")
            if s is not None:
                self.on_state(s)
        return rv

    def run(self, stop: threading.Event, *, backoff_s: float = 5.0) -> None:
        """List and follow until *stop* is set; an API error waits *backoff_s* and lists again."""
        rv: str | None = None
        while not stop.is_set():
            try:
                if rv is None:
                    rv = self.sync()
                rv = self.follow(rv)
            except ApiError as e:
                log.warning("watching the pods of node %s: %s; listing again in %g s", self.node, e, backoff_s)
                rv = None
                stop.wait(backoff_s)
            except Exception:  # noqa: BLE001 - a bug in one report must not end the watch
                log.exception("watching the pods of node %s failed; listing again in %g s", self.node, backoff_s)
                rv = None
                stop.wait(backoff_s)

