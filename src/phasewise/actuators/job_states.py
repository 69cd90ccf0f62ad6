"""The job states an actuator is the source of, published on the job-events topic, signed with the cluster key.

:class:`JobStates` is the part of :class:`~phasewise.actuators.actuator.Actuator` that turns what it did
and what its backend saw into a job's states: ``started`` and ``rejected`` for a place decision, ``scaled``
for a service's replicas, ``frozen`` and ``thawed``, and from the backend's watch (or a Kubernetes pod
watch) ``finished``, ``failed`` and ``terminated``, each entered in the ledger before it is published once.
The lifecycle: docs/jobs.md, "Actuator".
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from phasewise.actuators.backends import Backend, JobExit
from phasewise.actuators.backends.job_watch import signal_name
from phasewise.actuators.backends.replicas import LocalReplicas
from phasewise.actuators.commands import Bind, Outcome, Scale, ScaleReplicas, StartJob
from phasewise.actuators.ledger import Ledger, StartedJob
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.kit.records import JOB_ID_PATTERN, Decision, JobEvent, encode
from phasewise.kit.records.jobs import MAX_REASON, MAX_REPLICAS
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import JOB_EVENTS

__all__ = ["AWAY", "JobStates", "job_of"]

log = logging.getLogger("phasewise.actuator")

#: why a job that ended while no actuator watched it failed, when nothing recorded says more
AWAY = "ended while the actuator was away (exit status unknown)"
_JOB_ID = re.compile(JOB_ID_PATTERN)


def _clip(text: str, limit: int = MAX_REASON) -> str:
    """*text* cut to *limit* characters (a job event's ``reason`` bound)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def job_of(d: Decision) -> str:
    """The job a decision is about: ``details.job`` where it names one, else its container."""
    job = d.details.get("job") if isinstance(d.details, dict) else None
    return job if isinstance(job, str) and job else d.container


class JobStates:
    """The job-state half of the actuator (a base of :class:`~phasewise.actuators.actuator.Actuator`, whose
    ``__init__`` sets what is declared here)."""

    settings: Settings
    backend: Backend
    ledger: Ledger
    producer: Any
    metrics: ActuatorMetrics
    keyring: Keyring | None
    clock: Callable[[], float]
    lock: threading.RLock
    replicas: LocalReplicas | None
    _terminating: dict[str, tuple[str, float]]

    def _service_ended(self, container: str) -> str | None:
        """A service's first replica ended: its other replicas and its endpoint go with it."""
        if self.replicas is None or container not in self.replicas.balancers:
            return None
        a = self.settings.actuator
        ended = self.replicas.ended(container, min(a.terminate_grace_s, a.terminate_grace_max_s))
        log.info("service %s ended: %s", container, ended)
        return ended

    def _started(self, d: Decision, cmd: Any, out: Outcome) -> None:
        """Enter a job this actuator started in its registry and announce it (a ``started`` job event).

        A dry run's start is entered (for the dry run's own later decisions) but not announced:
        no process runs.
        """
        if isinstance(cmd, Bind):  # the kubelet starts the pod: its watch enters and announces it (pod_seen)
            return
        job = cmd.job if isinstance(cmd, StartJob) and cmd.job else job_of(d)
        digest = d.details.get("spec_digest") if isinstance(d.details, dict) else None
        ident = getattr(self.backend, "identity", None)
        who = ident(d.container) if ident is not None and out.pid is not None else None
        proc_start, oom_base = (who[1], who[2]) if who is not None and who[0] == out.pid else (None, None)
        self.ledger.record_start(d.container, job=job, decision=d.id, backend=self.backend.name, pid=out.pid,
                                 spec_digest=digest if isinstance(digest, str) else "", now=self.clock(),
                                 proc_start=proc_start, oom_base=oom_base)
        if out.pid is None or not _JOB_ID.match(job):
            return
        details = d.details if isinstance(d.details, dict) else {}
        workload, priority = details.get("workload"), details.get("priority")
        cgroup = getattr(self.backend, "cgroup_of", None)
        cpus = cmd.cpus if isinstance(cmd, StartJob) and cmd.cpus else None
        gpus = cmd.gpus if isinstance(cmd, StartJob) and cmd.gpus else ()
        ev = JobEvent(job=job, ts=self.clock(), kind="started", host=self.settings.host, container=d.container,
                      pid=out.pid, cgroup=cgroup(d.container) if cgroup is not None else None, cpuset=cpus,
                      devices=tuple(str(g) for g in gpus),
                      workload=workload if workload in ("training", "inference", "interactive") else "training",
                      priority=priority if isinstance(priority, int) and not isinstance(priority, bool)
                      and abs(priority) <= 10**9 else 0)
        self._job_event(ev)

    def _job_event(self, ev: JobEvent) -> None:
        """Publish one of the job's states on the job-events topic, signed with the cluster key."""
        key, value = ev.job.encode(), encode(ev)
        headers = None if self.keyring is None else self.keyring.headers(JOB_EVENTS.name, key, value)
        self.producer.produce(JOB_EVENTS.name, key=key, value=value, headers=headers)
        self.producer.poll(0)
        self.metrics.job_states.labels(kind=ev.kind).inc()
        log.log(logging.WARNING if ev.kind in ("rejected", "failed") else logging.INFO, "job %s %s%s", ev.job,
                ev.kind, f": {ev.reason}" if ev.reason else "")

    def _rejected(self, d: Decision, reason: str) -> None:
        """A place decision this actuator refused or could not carry out: the job's ``rejected`` state."""
        if d.action != "place":
            return
        job = job_of(d)
        if not _JOB_ID.match(job):
            return
        self._job_event(JobEvent(job=job, ts=self.clock(), kind="rejected", host=self.settings.host,
                                 container=d.container, reason=_clip(reason or "refused")))

    def _scaled(self, d: Decision, cmd: Scale | ScaleReplicas, replicas: int, notes: str | None) -> None:
        """A scale command ran (or failed half-way): the service's ``scaled`` state, with the replicas running
        now and the most this actuator runs (the autoscaler counts on them; the placement agent books the
        local replicas on the first one's node). A Deployment's pods are placed by Kubernetes: no host."""
        self._publish_scaled(job_of(d), None if isinstance(cmd, Scale) else self.settings.host, d.container,
                             replicas, cmd.most, notes)

    def _publish_scaled(self, job: str, host: str | None, container: str, replicas: int, most: int | None,
                        reason: str | None) -> None:
        if _JOB_ID.match(job):
            self._job_event(JobEvent(job=job, ts=self.clock(), kind="scaled", workload="inference", host=host,
                                     container=container, replicas=min(replicas, MAX_REPLICAS),
                                     max_replicas=None if most is None else min(most, MAX_REPLICAS),
                                     reason=_clip(reason) if reason else None))

    def _replica_ended(self, e: JobExit) -> None:
        """A service's replica k > 1 ended on its own (not stopped by a scale command): the service's
        ``scaled`` state with the replicas still running."""
        service = e.container.rpartition("@r")[0]
        started = self.ledger.started_job(service)
        if self.replicas is None or not service or started is None or started.ended is not None:
            return
        ports = self.replicas.balancers.get(service)
        n = len(self.replicas.running(service, ports.port)) if ports is not None else 0
        why = f"replica {e.container} ended on its own" + (f" (exit status {e.returncode})"
                                                            if e.returncode is not None else "")
        self._publish_scaled(started.job, self.settings.host, service, n, self.settings.actuator.max_replicas, why)

    def _froze(self, d: Decision, kind: str) -> None:
        """A freeze or thaw decision was applied to a job's container: its ``frozen`` / ``thawed`` state."""
        job = job_of(d)
        if _JOB_ID.match(job):
            self._job_event(JobEvent(job=job, ts=self.clock(), kind=kind, host=self.settings.host,
                                     container=d.container, reason=_clip(d.reason) if d.reason else None))

    def job_ended(self, e: JobExit) -> JobEvent | None:
        """The backend saw a job process it started (or found again) end: record it and publish its
        terminal state (``finished``, ``failed`` or ``terminated``) once; the event, or ``None`` when
        the registry has no running job of that container and pid (already reported, or replaced). A
        service replica's end (k > 1) is entered in the registry alone (the service's state is its first
        replica's); a service's first replica's end takes the other replicas and the endpoint with it."""
        if self.replicas is not None and self.replicas.is_replica(e.container):
            with self.lock:
                row = self.ledger.started_job(e.container)
                on_its_own = row is not None and row.ended is None  # (a scale command's stop ended it first)
                self.ledger.record_end(e.container, pid=e.pid, exit_status=e.returncode, now=e.ended)
                self.replicas.names.discard(e.container)
                if on_its_own:
                    self._replica_ended(e)
            return None
        ev = self._job_ended(e)
        if ev is not None:
            self._service_ended(e.container)
        return ev

    def _job_ended(self, e: JobExit) -> JobEvent | None:
        with self.lock:
            row = self.ledger.started_job(e.container)
            if row is None or row.pid != e.pid or row.ended is not None or row.backend != self.backend.name:
                log.info("end of pid %d in %s: not a running job of this actuator's registry (already "
                         "reported?)", e.pid, e.container)
                self.metrics.job_ends_ignored.inc()
                return None
            ev = self._end_event(row, e)
            self.ledger.record_end(e.container, pid=e.pid, exit_status=e.returncode, now=e.ended,
                                   end_event=encode(ev))
            self._terminating.pop(e.container, None)
            self._job_event(ev)
            self._remove_ended(ev)
            self.ledger.record_published(e.container, pid=e.pid, now=self.clock())
            return ev

    def _remove_ended(self, ev: JobEvent) -> None:
        """A job this actuator started ended (its end published): remove its container's cgroups
        (``actuator_remove_ended_jobs``). Before the end is marked published, so that an actuator stopped in
        between publishes it again after its restart and removes them then. A job terminated by a checkpoint
        stop keeps them: the priority agent resumes it in its container."""
        remove = getattr(self.backend, "remove_container", None)
        if (remove is None or not self.settings.actuator.remove_ended_jobs or ev.container is None
                or (ev.kind == "terminated" and self.ledger.resumable(ev.container))
                or not self.backend.exists(ev.container)):
            return
        why = remove(ev.container)
        if why is None:
            self.metrics.job_cgroups_removed.labels(outcome="removed").inc()
            log.info("job %s %s: its container %s removed", ev.job, ev.kind, ev.container)
        else:
            self.metrics.job_cgroups_removed.labels(outcome="left").inc()
            log.warning("job %s %s: its container %s stays: %s", ev.job, ev.kind, ev.container, why)

    def pod_seen(self, s: Any) -> JobEvent | None:
        """A job pod's state from the Kubernetes backend's pod watch
        (:class:`~phasewise.actuators.backends.kubernetes.pod_watch.PodJobState`): entered in the registry
        (the pod's uid names it) and published once; the event, or ``None`` when already published."""
        with self.lock:
            row = self.ledger.started_job(s.container)
            tag = f"pod {s.uid}"
            same = row is not None and row.decision == tag and row.backend == self.backend.name
            if s.kind == "started":
                if same:
                    return None
                self.ledger.record_start(s.container, job=s.job, decision=tag, backend=self.backend.name, pid=None,
                                         now=s.started if s.started is not None else self.clock())
                ev = JobEvent(job=s.job, ts=self.clock(), kind="started", host=self.settings.host,
                              container=s.container)
                self._job_event(ev)
                return ev
            if not same:  # seen only once it had ended (between two looks, or before this actuator ran)
                first = s.started if s.started is not None else s.ended
                self.ledger.record_start(s.container, job=s.job, decision=tag, backend=self.backend.name, pid=None,
                                         now=first if first is not None else self.clock())
                row = self.ledger.started_job(s.container)
            elif row.ended is not None:
                self.metrics.job_ends_ignored.inc()
                return None
            assert row is not None
            kind, reason = ("failed" if s.kind == "gone" else s.kind), s.reason
            if s.uid in getattr(self.backend, "deleted", {}):
                kind = "terminated"
                reason = "its pod was deleted for a terminate decision" + (f" ({s.reason})" if s.reason else "")
            ended = s.ended if s.ended is not None else self.clock()
            run_s = s.run_s if s.run_s is not None else max(0.0, ended - row.started)
            ev = JobEvent(job=s.job, ts=self.clock(), kind=kind, host=self.settings.host, container=s.container,
                          exit_code=s.exit_code, signal=s.signal, oom=s.oom, run_s=run_s,
                          reason=_clip(reason) if reason and kind != "finished" else None)
            self.ledger.record_end(s.container, now=ended, end_event=encode(ev))
            self._job_event(ev)
            self.ledger.record_published(s.container, pid=None, now=self.clock())
            return ev

    def pods_listed(self, present: set[str]) -> int:
        """The pod watch listed the node's job pods (*present*: ``namespace/name``): the registry's running
        pods missing from it ended while nothing watched them (``failed``, :data:`AWAY`); how many."""
        n = 0
        with self.lock:
            for row in self.ledger.running_jobs(self.backend.name):
                if row.pid is not None or not row.decision.startswith("pod ") or row.container in present:
                    continue
                uid = row.decision[4:]
                asked = uid in getattr(self.backend, "deleted", {})
                now = self.clock()
                ev = JobEvent(job=row.job, ts=now, kind="terminated" if asked else "failed", host=self.settings.host,
                              container=row.container, run_s=max(0.0, now - row.started),
                              reason=("its pod was deleted for a terminate decision (exit status unknown)" if asked
                                      else f"{AWAY}: its pod is gone"))
                self.ledger.record_end(row.container, now=now, end_event=encode(ev))
                self._job_event(ev)
                self.ledger.record_published(row.container, pid=None, now=now)
                n += 1
        return n

    def _end_event(self, row: StartedJob, e: JobExit) -> JobEvent:
        signame = signal_name(e.signal) if e.signal is not None else None
        code = e.exit_code if e.exit_code is not None and 0 <= e.exit_code <= 255 else None
        how = (f"killed by {signame}" if signame else f"exited with status {e.exit_code}" if e.known
               else "exit status unknown")
        run_s = max(0.0, e.ended - row.started)
        asked = self._terminating.get(e.container)
        by = asked[0] if asked is not None and e.ended >= asked[1] else None
        if by is None and (t := self.ledger.terminated(e.container)) is not None and t[1] >= row.started:
            by = t[0]
        common = dict(job=row.job, ts=e.ended, host=self.settings.host, container=row.container, pid=row.pid,
                      exit_code=code, signal=signame, oom=e.oom, run_s=run_s)
        if by is not None:
            return JobEvent(kind="terminated", reason=_clip(f"terminated by decision {by} ({how})"), **common)
        if e.known and e.exit_code == 0 and not e.oom:
            return JobEvent(kind="finished", **common)
        why = []
        if e.oom:
            n = e.oom_kills or 1
            why.append(f"OOM-killed: the kernel's OOM killer killed {n} process{'es' if n > 1 else ''} in its "
                       "memory limit")
        why.append(how if e.known else AWAY)
        return JobEvent(kind="failed", reason=_clip("; ".join(why)), **common)
