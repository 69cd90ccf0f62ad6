"""The actuator's step: one decisions-topic message to at most one applied command and its ``Actuation``.

:class:`Actuator` decodes a decision (a bad one becomes a dead letter),
claims its id in the ledger, checks the workload's mode, who owns the
container and the job's signature, plans the command under the safety rules,
applies it through the backend with retries and publishes the outcome. It
also publishes the job states it is the source of (:mod:`.job_states`):
started, rejected, scaled, frozen, thawed, and, from the backend's watch,
finished, failed and terminated (docs/jobs.md, "Actuator"). It is Kafka-free apart from
``producer.produce``; the loop around it is
:mod:`phasewise.actuators.consumer`. The steps in order: docs/operations.md,
"The actuator".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from phasewise.actuators.backends import Backend, CgroupBackend
from phasewise.actuators.backends.gpu_share_enforcement import carry, start_environment
from phasewise.actuators.backends.replicas import LocalReplicas
from phasewise.actuators.commands import Outcome, Scale, ScaleReplicas, SetLimits, StartJob
from phasewise.actuators.job_states import AWAY, JobStates, job_of
from phasewise.actuators.ledger import Ledger, StartedJob
from phasewise.actuators.metrics import ActuatorMetrics
from phasewise.actuators.safety import (
    SUPPORTED_ACTIONS,
    PeakTracker,
    Planned,
    declared_peak,
    is_managed_name,
    not_applied_reason,
    plan,
)
from phasewise.kit.job_signing import SubmitterKeys, spec_of
from phasewise.kit.records import (
    Actuation,
    Decision,
    JobEvent,
    SchemaError,
    WorkloadPolicy,
    brief,
    decode,
    encode,
)
from phasewise.kit.settings import Settings
from phasewise.kit.signing import Keyring
from phasewise.kit.topics import ACTUATIONS, DECISIONS
from phasewise.models.safety.workload import resolve

__all__ = ["AWAY", "NOT_STARTING", "OWNED_ACTIONS", "Actuator", "job_of", "touches_a_job"]

log = logging.getLogger("phasewise.actuator")


class _Produces(Protocol):
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, **kw: Any) -> None: ...

    def poll(self, timeout: float = ...) -> int: ...



#: a place decision's refusal while ``actuator_start_jobs`` is off
NOT_STARTING = "this actuator does not start jobs (actuator_start_jobs is off)"
#: a scale decision's refusal where no replica can be started (``actuator_start_jobs`` off, a dry run)
NOT_SCALING = "this actuator starts no replicas (actuator_start_jobs is off or its backend starts no process)"
#: the actions that touch a job's container: taken only on a container the actuator owns for that job
OWNED_ACTIONS = ("freeze", "thaw", "terminate", "weight", "share")
#: share decisions held for jobs not started yet (the oldest go beyond this)
MAX_HELD_SHARES = 10_000


def touches_a_job(d: Decision) -> bool:
    """Whether *d* acts on a job's existing container (freeze, thaw, terminate, weight, resume)."""
    return d.action in OWNED_ACTIONS or d.is_resume



class Actuator(JobStates):
    """Turns one decisions-topic message into at most one applied command and its Actuation.

    Kafka-free apart from ``producer.produce`` (actuations, dead letters), so
    :meth:`handle` is tested with any object that has ``produce`` and ``poll``.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        ledger: Ledger,
        producer: _Produces,
        *,
        metrics: ActuatorMetrics | None = None,
        host_cores: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = time.sleep,
        workloads: Any = None,
        keyring: Keyring | None = None,
        submitters: SubmitterKeys | None = None,
    ) -> None:
        self.settings = settings
        #: this host's :class:`~phasewise.kit.cgroups.workloads.Workloads`; None: every container takes the
        #: default mode of the flat layout (``workload_default_mode``)
        self.workloads = workloads
        self.backend = backend
        self.ledger = ledger
        self.producer = producer
        self.metrics = ActuatorMetrics() if metrics is None else metrics
        self.host_cores = float(host_cores if host_cores is not None else (os.cpu_count() or 1))
        #: the CPU ids place decisions may bind jobs to (this process's affinity)
        self.host_cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(
            range(os.cpu_count() or 1))
        self.clock = clock
        self.sleep = sleep
        #: the working sets this actuator read, for the memory floor's recent peak
        self.peaks = PeakTracker(settings.safety.peak_window_s)
        #: verifies the decisions' signatures (``signing_key_file``; ``None``: not checked)
        self.keyring = keyring
        #: the submitters whose signed jobs this actuator starts (``job_trusted_submitters``; ``None``: none)
        self.submitters = submitters
        #: the decision behind each resize the backend watches (update-mode in-place-or-recreate), whose
        #: later outcome (:meth:`follow_up`) is published as a further actuation of that decision
        self._resizes: dict[str, Decision] = {}
        #: local inference replicas behind one endpoint each (a cgroup backend that starts jobs; else None)
        self.replicas: LocalReplicas | None = None
        self._deciding = ""  # the decision being applied (a replica's registry entry names it)
        if isinstance(backend, CgroupBackend) and backend.jobs is not None:
            self.replicas = LocalReplicas(
                backend, state_file=Path(settings.data_dir) / "replica-services.json",
                on_start=lambda c, job, pid: self.ledger.record_start(c, job=job, decision=self._deciding,
                                                                      backend=self.backend.name, pid=pid,
                                                                      now=self.clock()),
                on_stop=lambda c: self.ledger.record_end(c, now=self.clock()))
        if hasattr(backend, "on_fallback"):
            backend.on_fallback = lambda outcome: self.metrics.resize_fallbacks.labels(outcome=outcome).inc()
        #: one decision or one job's end at a time: the backend reports ends from its watcher's thread
        self.lock = threading.RLock()
        #: containers a terminate decision is stopping: ``(decision id, when it began)``; an end seen after
        #: that is ``terminated``, not ``failed``
        self._terminating: dict[str, tuple[str, float]] = {}
        if hasattr(backend, "on_exit"):
            backend.on_exit = self.job_ended

    # ------------------------------------------------------------------ one message

    def handle(self, decision_bytes: bytes | None, key: bytes | None, partition: int | None,
               offset: int | None, *, topic: str = DECISIONS.name, headers: Any = None,
               produced_at: float | None = None) -> Actuation | None:
        """Handle one message; returns the published Actuation, or ``None`` (dead-lettered / other host).

        *headers*: the message's Kafka headers (its signature, checked when a keyring is set).
        *produced_at*: the record's Kafka timestamp (s), for the decision-to-actuation latency.
        """
        with self.lock:
            return self._handle(decision_bytes, key, partition, offset, topic=topic, headers=headers,
                                produced_at=produced_at)

    def _handle(self, decision_bytes: bytes | None, key: bytes | None, partition: int | None,
                offset: int | None, *, topic: str, headers: Any, produced_at: float | None) -> Actuation | None:
        from phasewise.kit.kafka.client import (
            publish_dead_letter,  # confluent_kafka only where a message is bad
        )

        try:
            d = decode(Decision, decision_bytes)
            reason = None
        except SchemaError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - decode raises SchemaError only; a record never stops the actuator
            log.exception("decoding a decision failed")
            reason = f"could not decode: {type(e).__name__}: {e}"
        if reason is not None:
            log.warning("malformed decision at %s[%s]@%s: %s", topic, partition, offset, brief(reason, 300))
            publish_dead_letter(self.producer, source_topic=topic, reason=reason, payload=decision_bytes,
                                key=key, partition=partition, offset=offset,
                                max_bytes=self.settings.kafka.dead_letter_max_bytes)
            self.metrics.dead_letters.inc()
            return None
        if d.host != self.settings.host:
            log.debug("decision %s is for host %s, not %s: skipped", d.id, d.host, self.settings.host)
            self.metrics.ignored.inc()
            return None
        if self.keyring is not None:
            # before the ledger: an unsigned record must not claim the id of a genuine decision
            refused = self.keyring.verify(topic, key, decision_bytes, headers, now=self.clock())
            if refused is not None:
                reason = f"decision {brief(d.id, 80)} refused: {refused}"
                log.warning("%s[%s]@%s: %s", topic, partition, offset, reason)
                publish_dead_letter(self.producer, source_topic=topic, reason=reason, payload=decision_bytes,
                                    key=key, partition=partition, offset=offset,
                                    max_bytes=self.settings.kafka.dead_letter_max_bytes)
                self.metrics.refused.labels(reason="signature").inc()
                return None
        stale = self._stale(d)
        if stale is not None:  # not claimed: the ledger holds only ids this actuator acted on
            self.metrics.refused.labels(reason=stale[0]).inc()
            self._rejected(d, stale[1])
            return self._publish(d, Outcome("rejected", stale[1]))

        if not self.ledger.claim(d.id, container=d.container, now=self.clock()):
            prev = self.ledger.get(d.id)
            what = (f"{prev.status}" if prev and prev.status else "interrupted before its outcome was recorded")
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(prev.claimed)) if prev else "?"
            msg = f"decision already handled at {when}: {what}; not applied again"
            return self._publish(d, Outcome("duplicate", msg))

        try:
            outcome = self._decide_and_apply(d)
        except Exception as e:  # a bug must still leave a report and a ledger entry, not a silent claim
            log.exception("error handling decision %s", d.id)
            outcome = Outcome.failed(f"actuator error: {type(e).__name__}: {e}")
        self.ledger.finish(d.id, outcome.status, outcome.message)
        if d.action == "place" and outcome.status not in ("applied", "clamped"):
            self._rejected(d, outcome.message)
        if produced_at is not None:
            self.metrics.decision_latency.observe(max(0.0, self.clock() - produced_at))
        return self._publish(d, outcome)

    def _workload(self, container: str) -> WorkloadPolicy | str:
        """The container's resolved policy, or why it is no workload at all."""
        if self.workloads is None:
            return resolve(None, "flat", self.settings.workload.default_mode)
        who = self.workloads.describe(container)
        if who is None:
            return f"container {container!r} is a pod's sandbox (pause) container, not a workload"
        return who[1]

    def _stale(self, d: Decision) -> tuple[str, str] | None:
        """``(metric reason, message)`` when *d*'s event time is outside the freshness limits."""
        a = self.settings.actuator
        age = self.clock() - d.ts
        if a.decision_max_age_s and age > a.decision_max_age_s:
            return "stale", (f"decision is {age:.0f} s old, more than decision_max_age_s ({a.decision_max_age_s:g} s); "
                             "not applied")
        if a.decision_max_future_s and -age > a.decision_max_future_s:
            return "future", (f"decision is stamped {-age:.0f} s ahead of this host's clock, more than "
                              f"decision_max_future_s ({a.decision_max_future_s:g} s); not applied")
        return None

    def _not_owned(self, d: Decision, workload: WorkloadPolicy | None) -> str | None:
        """Why this actuator must not act on *d*'s existing container for *d*'s job; ``None``: it owns it.

        It owns a container it started for that job (its registry; a dry run's "starts" own nothing
        for another backend), or one whose workload says it is that job's (``phasewise.io/job``).
        """
        c, job = d.container, job_of(d)
        started = self.ledger.started_job(c)
        if started is not None and started.backend == self.backend.name:
            if started.job == job:
                return None
            return (f"container {c!r} was started by this actuator for job {started.job!r}, not {job!r}: "
                    f"{d.action} refused")
        if workload is not None and workload.job is not None:
            if workload.job == job:
                return None
            return (f"container {c!r} belongs to job {workload.job!r} (its workload's phasewise.io/job), "
                    f"not {job!r}: {d.action} refused")
        return (f"container {c!r} was not started by this actuator and its workload does not say it belongs to "
                f"job {job!r} (phasewise.io/job): {d.action} refused")

    def _decide_and_apply(self, d: Decision) -> Outcome:
        if d.action == "place" and not self.settings.actuator.start_jobs:
            self.metrics.refused.labels(reason="jobs_off").inc()
            return Outcome("rejected", NOT_STARTING)
        kubernetes = self.backend.name == "kubernetes"
        if d.action == "scale" and not kubernetes and (self.replicas is None or not self.settings.actuator.start_jobs):
            self.metrics.refused.labels(reason="jobs_off").inc()
            return Outcome("rejected", NOT_SCALING)
        self._deciding = d.id
        if d.action == "place" and not d.is_resume and (over := self._over(d.container)) is not None:
            return Outcome("rejected", over)
        exists = is_managed_name(d.container) and self.backend.exists(d.container)
        if d.action == "terminate" and not exists and (ended := self._ended_and_removed(d.container)) is not None:
            return Outcome.applied(ended)
        workload = None
        if exists and d.action in SUPPORTED_ACTIONS:
            w = self._workload(d.container)
            if isinstance(w, str):
                return Outcome("rejected", w)
            if w.mode != "apply":
                return Outcome("rejected", not_applied_reason(d.container, w))
            workload = w
        if exists and touches_a_job(d):
            why = self._not_owned(d, workload)
            if why is not None:
                self.metrics.refused.labels(reason="not_owner").inc()
                return Outcome("rejected", why)
        if d.action == "share":
            return self._share(d, exists)
        usage = peak = None
        if exists and d.action == "limit" and d.mem_limit_bytes is not None:
            usage = self.backend.memory_usage(d.container)
            now = self.clock()
            if usage is not None and math.isfinite(usage) and usage >= 0:
                self.peaks.add(d.container, now, usage)
            own = self.peaks.peak(d.container, now)
            peak = max((v for v in (own, declared_peak(d)) if v is not None), default=None)
        terminated = None
        if d.action == "terminate" and (t := self.ledger.terminated(d.container)) is not None:
            terminated = f"by decision {t[0]} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(t[1]))}"
        p = plan(d, exists=exists, usage_mem_bytes=usage, host_cores=self.host_cores, settings=self.settings,
                 peak_mem_bytes=peak, workload=workload, host_cpus=self.host_cpus, now=self.clock(),
                 terminated=terminated, submitters=self._trusted() if d.action in ("place", "scale") else None,
                 owned_by=self._owner(d.container, workload) if d.action in ("place", "scale") and exists else None,
                 kubernetes=kubernetes, started_spec=self._started_spec(d.container) if d.action == "scale" else None)
        if not isinstance(p, Planned):
            return Outcome("rejected", p.reason)
        if isinstance(p.command, StartJob) and not p.command.job:
            p = Planned(dataclasses.replace(p.command, job=job_of(d)), p.notes)
        shared = None
        if isinstance(p.command, StartJob) and (share := self._held_share(d.container)) is not None:
            env, _enforced, shared = start_environment(share, visible=p.command.gpus)
            p = Planned(dataclasses.replace(p.command, env=tuple(sorted(env.items()))), p.notes)
        if d.action == "terminate":  # an end seen from now on was asked for
            self._terminating[d.container] = (d.id, time.time())  # the watcher's clock
        out = self._apply_with_retries(p)
        if isinstance(p.command, (Scale, ScaleReplicas)) and out.replicas is not None:
            self._scaled(d, p.command, out.replicas, "; ".join(p.notes) or None)
        if d.action == "terminate" and out.status != "applied":
            self._terminating.pop(d.container, None)
        watched = getattr(self.backend, "watched", None)
        if watched is not None and isinstance(p.command, SetLimits):
            if d.container in watched:
                self._resizes[d.container] = d
            else:
                self._resizes.pop(d.container, None)
        if out.status != "applied":
            return out
        if d.action == "terminate":
            self.ledger.record_termination(d.container, d.id, self.clock(), resumable=d.is_checkpoint_stop)
            ended = self._service_ended(d.container)  # a service's other replicas and endpoint go with it
            row = self.ledger.started_job(d.container)
            if row is None or row.pid is None or not hasattr(self.backend, "on_exit"):
                # no process of its own is watched (a dry run, a container it did not start): ended here
                if row is not None:
                    self.ledger.record_end(d.container, now=self.clock())
                self._terminating.pop(d.container, None)
            # else its watcher reports the process's end (terminated), once this decision is done
            if ended:
                out = dataclasses.replace(out, message=f"{out.message}; {ended}")
        elif d.action == "place":  # a new job in the container: it may be terminated again
            self.ledger.forget_termination(d.container)
            self._started(d, p.command, out)
            served = self._serve(d)
            if served:
                out = dataclasses.replace(out, message=f"{out.message}; {served}")
        elif d.action in ("freeze", "thaw"):
            self._froze(d, "frozen" if d.action == "freeze" else "thawed")
        msg = "; ".join(m for m in (p.message, out.message, shared) if m)
        return Outcome(p.status, msg, out.cpu_cores, out.mem_bytes, pid=out.pid, replicas=out.replicas)

    def _share(self, d: Decision, exists: bool) -> Outcome:
        """A ``share`` decision: held for the job's start when its container does not exist yet (its place
        decision starts it under the share: the CUDA MPS environment), else advisory (MPS reads the limits
        when a client starts; HAMi when a pod is created)."""
        if not is_managed_name(d.container):
            return Outcome("rejected", f"container id {d.container!r} is not a managed container name")
        where = "hami" if self.backend.name == "kubernetes" else "mps"
        try:
            c = carry(d, where, running=exists)
        except ValueError as e:
            return Outcome("rejected", str(e))
        if exists:
            annotate = getattr(self.backend, "annotate", None)
            if where == "hami" and annotate is not None:
                out = annotate(d.container, c.annotations)
                if out.status != "applied":
                    return out
            carried = ", ".join(f"{k}={v}" for k, v in (c.resources or c.env).items())
            return Outcome("rejected", f"{c.message} (the job runs already; {carried})")
        if where == "hami":
            return Outcome("rejected", f"no pod on this node holds container {d.container!r}: on Kubernetes the "
                                       "share is carried by the job's pod (HAMi resources)")
        self.ledger.hold_share(d.container, encode(d), most=MAX_HELD_SHARES, now=self.clock())
        return Outcome("applied", f"held for the start of job {job_of(d)}: its place decision starts it under "
                                  f"{d.details['sm_percent']} % of GPU {d.details.get('device', 0)}'s threads and "
                                  f"{d.details['mem_limit_bytes'] // 2**20} MiB (CUDA MPS)")

    def _held_share(self, container: str) -> Decision | None:
        """The share decision held in the ledger (across restarts) for *container*'s start, taken."""
        raw = self.ledger.take_share(container)
        if raw is None:
            return None
        try:
            return decode(Decision, raw)
        except SchemaError as e:  # (written by this actuator from a verified decision: a version it cannot read)
            log.error("the share held for %s cannot be read (%s): it starts without one", container, e)
            return None

    def _serve(self, d: Decision) -> str | None:
        """After a place decision started an inference service's first replica: open its endpoint."""
        if self.replicas is None or not isinstance(d.details, dict):
            return None
        try:
            svc = spec_of(d.details.get("spec")).service  # (verified before the start)
        except ValueError:
            return None
        if svc is None:
            return None
        try:
            self.replicas.serve(d.container, svc.port)
        except OSError as e:
            log.error("service %s: %s", d.container, e)
            return f"its endpoint could not be opened: {e}"
        return f"service endpoint 127.0.0.1:{svc.port} -> replica 1 on port {svc.port + 1}"

    def _ended(self, container: str) -> tuple[StartedJob, str] | None:
        """The registry row of the job this actuator started in *container* and the kind of the end it recorded
        (``finished``, ``failed``, ``terminated``); ``None`` when it recorded none (or none it can read)."""
        row = self.ledger.started_job(container)
        if row is None or row.backend != self.backend.name or row.ended is None or row.end_event is None:
            return None
        try:
            return row, decode(JobEvent, row.end_event).kind
        except SchemaError:
            return None

    def _over(self, container: str) -> str | None:
        """Why no place decision may start a job in *container* again: this actuator started one there that
        finished or failed (its container may be gone: ``actuator_remove_ended_jobs``); ``None`` otherwise.
        A resume (``details.resume``) is not asked: a job that honoured its checkpoint stop's control before
        the terminate decision reached this actuator was reported finished or failed, and its agent resumes it
        (in a container made again where its end removed it)."""
        ended = self._ended(container)
        if ended is None or ended[1] not in ("finished", "failed"):
            return None
        row, kind = ended
        return f"job {row.job!r} already ran in container {container!r} and {kind}: a placed job is started once"

    def _ended_and_removed(self, container: str) -> str | None:
        """What to say of a terminate for *container* whose job this actuator saw end and whose container went
        with its end (a job that honoured its checkpoint stop's control before the terminate came); ``None``
        when the registry holds no such end."""
        ended = self._ended(container)
        if ended is None:
            return None
        row, kind = ended
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row.ended))
        return f"job {row.job!r} already ended ({kind} at {at}) and its container went with it: nothing to stop"

    def _started_spec(self, container: str) -> str | None:
        """The spec digest this actuator started *container*'s job with (``None``: it did not, or no digest)."""
        started = self.ledger.started_job(container)
        if started is None or started.backend != self.backend.name:
            return None
        return getattr(started, "spec_digest", None) or None

    # ------------------------------------------------------------------ the jobs' ends

    def watched_gauge(self) -> None:
        """Set ``phasewise_actuator_jobs_watched`` from the backend (called by the loop between polls)."""
        watching = getattr(self.backend, "watching", None)
        if watching is not None:
            self.metrics.jobs_watched.set(len(watching()))

    def recover(self) -> dict[str, int]:
        """After a restart: watch again the jobs of the registry still running, report those that ended
        while no actuator watched them, and publish the ends decided but not published. Counts by what
        came of each (``watched``, ``ended``, ``republished``)."""
        counts = {"watched": 0, "ended": 0, "republished": 0}
        with self.lock:
            for row in self.ledger.unpublished_ends():
                try:
                    ev = decode(JobEvent, row.end_event)
                except SchemaError as err:
                    log.error("registry row of %s holds an undecodable end event (%s): not published", row.container,
                              err)
                    self.ledger.record_published(row.container, pid=row.pid, now=self.clock())
                    continue
                self._job_event(ev)
                self._remove_ended(ev)
                self.ledger.record_published(row.container, pid=row.pid, now=self.clock())
                counts["republished"] += 1
            watch_pods = getattr(self.backend, "watch_pods", None)
            if watch_pods is not None:  # the Kubernetes backend: the states come from its pod watch
                watch_pods(self.pod_seen, self.pods_listed)
            adopt = getattr(self.backend, "adopt", None)
            if adopt is None:
                return counts
            for row in self.ledger.running_jobs(self.backend.name):
                if row.pid is None:
                    continue
                why = adopt(row.container, row.pid, row.proc_start, row.oom_base)
                if why is None:
                    counts["watched"] += 1
                    log.info("job %s (pid %d in %s) runs: watched again", row.job, row.pid, row.container)
                    continue
                log.warning("job %s (pid %d in %s) is not running: %s", row.job, row.pid, row.container, why)
                away = self.backend.ended_while_away  # type: ignore[attr-defined]
                self.job_ended(away(row.container, row.pid, row.proc_start, row.oom_base))
                counts["ended"] += 1
        for k, n in counts.items():
            self.metrics.jobs_recovered.labels(outcome=k).inc(n)
        return counts

    def _owner(self, container: str, workload: WorkloadPolicy | None) -> str | None:
        """The job *container* belongs to: the one this actuator started in it, else its workload's ``job``."""
        started = self.ledger.started_job(container)
        if started is not None and started.backend == self.backend.name:
            return started.job
        return getattr(workload, "job", None) or None

    def _trusted(self) -> SubmitterKeys | None:
        """The trusted submitter keys, read again when their files changed (rotation, revocation)."""
        if self.submitters is not None and self.submitters.refresh():
            if self.submitters.error is not None:
                log.error("trusted submitters: %s; no job is started until they can be read", self.submitters.error)
            else:
                log.info("trusted submitters read again: %s", self.submitters.describe())
        return self.submitters

    def _apply_with_retries(self, p: Planned) -> Outcome:
        s = self.settings
        t0 = time.perf_counter()
        attempts = max(0, s.actuator.apply_retries) + 1
        backend: Any = self.backend
        if isinstance(p.command, ScaleReplicas) and self.replicas is not None:
            backend = self.replicas
        for attempt in range(attempts):
            try:
                out = backend.apply(p.command)
            except Exception as e:  # a backend bug must not lose the decision's report
                log.exception("backend %s raised on %r", self.backend.name, p.command)
                out = Outcome.failed(f"backend {self.backend.name} raised {type(e).__name__}: {e}")
            if out.status != "failed" or not out.temporary:
                break
            if attempt + 1 == attempts:
                out = Outcome.failed(f"{out.message} (temporary error; gave up after {attempts} attempts)",
                                     temporary=True, cpu_cores=out.cpu_cores, mem_bytes=out.mem_bytes,
                                     replicas=out.replicas)
                break
            delay = s.actuator.apply_retry_backoff_s * 2**attempt
            log.warning("temporary error applying %r (attempt %d/%d), retrying in %.2fs: %s",
                        p.command, attempt + 1, attempts, delay, out.message)
            self.metrics.retries.inc()
            self.sleep(delay)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        return out

    def follow_up(self) -> list[Actuation]:
        """Carry on with the resizes the backend watches (``update-mode: in-place-or-recreate``): each that
        ended in an eviction, or could not, is published as a further actuation of the decision that asked
        for it (its ledger entry updated). Called by the consumer loop between polls; cheap when nothing
        is watched or due."""
        with self.lock:
            return self._follow_up()

    def _follow_up(self) -> list[Actuation]:
        check = getattr(self.backend, "follow_up", None)
        if check is None or not self.backend.watched:  # type: ignore[attr-defined]
            if self._resizes:
                self._resizes.clear()
            return []
        acts = []
        try:
            done = check()
        except Exception:  # a bug here must not stop the decisions from being applied
            log.exception("checking the watched resizes failed")
            return []
        for container, out in done:
            d = self._resizes.pop(container, None)
            if d is None:
                log.warning("container %s: %s", container, out.message)
                continue
            self.ledger.finish(d.id, out.status, out.message)
            acts.append(self._publish(d, out, count=False))
        if len(self._resizes) > len(self.backend.watched):  # type: ignore[attr-defined]
            for c in [c for c in self._resizes if c not in self.backend.watched]:  # type: ignore[attr-defined]
                del self._resizes[c]
        return acts

    def _publish(self, d: Decision, out: Outcome, *, count: bool = True) -> Actuation:
        def finite(x: float | None) -> float | None:
            return None if x is None or not math.isfinite(x) else float(x)

        act = Actuation(
            decision_id=d.id,
            ts=self.clock(),
            host=self.settings.host,
            container=d.container,
            status=out.status,
            backend=self.backend.name,
            message=out.message,
            cpu_limit_cores=finite(out.cpu_cores),
            mem_limit_bytes=finite(None if out.mem_bytes is None else float(out.mem_bytes)),
            decision_ts=d.ts,
        )
        self.producer.produce(ACTUATIONS.name, key=self.settings.host.encode(), value=encode(act))
        self.producer.poll(0)
        if count:  # a follow-up of a decision already counted is not another decision
            self.metrics.decisions.labels(status=out.status).inc()
        level = logging.WARNING if out.status in ("failed", "rejected") else logging.INFO
        log.log(level, "decision %s (%s %s, policy %s): %s %s", d.id, d.action, d.container, d.policy,
                out.status, out.message)
        return act

