"""``phasewise actuate``: apply this host's decisions to its containers and report each.

For every message on the decisions topic the actuator:

1. decodes it as a :class:`~phasewise.kit.records.Decision`; a message it cannot
   decode (a null value, any bytes, any size, nesting or numbers too large to
   parse, wrong types or values) goes to the dead-letter topic with the
   reason, partition and offset (a payload too large for
   ``dead_letter_max_bytes`` cut and marked ``truncated``) and the actuator
   carries on;
2. skips decisions for other hosts (see "Which partitions" below);
3. claims the decision id in the ledger; an id already there is reported as
   ``duplicate`` and not applied again;
4. resolves the container's per-workload policy on this host
   (:class:`~phasewise.kit.cgroups.workloads.Workloads`: annotations, policy file, default
   mode) and refuses (``rejected``, with the reason) any decision for a
   container not opted in as ``apply``: ``recommend`` containers are decided
   and published but never written, ``off`` ones are not managed;
5. refuses (``rejected``) a ``place`` decision unless ``actuator_start_jobs``
   is on, and a ``freeze``, ``thaw``, ``terminate``, ``weight`` or resume
   decision for an existing container it does not own: one it started for
   the decision's job (its registry, :class:`~phasewise.actuators.ledger.StartedJob`)
   or whose workload says it is that job's (``phasewise.io/job``);
6. plans a command under the safety rules (managed, existing container;
   CPU floor and host cap; the workload's own min/max; memory never under
   usage, or the recent peak working set, + margin; a container terminated
   once, within a bounded grace period; a CPU weight within its bounds; a
   job started once, or resumed in its emptied container, and only a job a
   trusted submitter signed, whose signed spec's command is what runs:
   :mod:`phasewise.actuators.job_trust`);
7. applies it through the backend (``cgroup``, ``dry-run`` or ``kubernetes``), retrying
   temporary errors a few times with doubling backoff; a job it started is
   entered in its registry and announced by a ``started``
   :class:`~phasewise.kit.records.JobEvent` (key: the job; signed with the
   cluster key when it has one);
8. records the outcome in the ledger and publishes an
   :class:`~phasewise.kit.records.Actuation` (key: host, with ``decision_ts`` so
   decision-to-actuation latency can be measured);
9. commits the offsets only after the actuations were delivered. Kafka
   delivery is at least once; with the ledger each decision id is applied at
   most once. An error that is no message's (ledger, backend, Kafka) stops
   the actuator with exit status 1 after committing the messages it handled.

Which partitions: decisions are keyed by host, so one host's decisions stay
in order in one partition; the worker's producer picks it with Kafka's
murmur2 partitioner (:mod:`phasewise.kit.kafka.partitions`). Each host's actuator uses
its own consumer group (``phasewise-actuator-<host>``) and, with
``actuator_read_partitions=host`` (the default), reads only the partition
its host's key maps to (:func:`own_partition`, recomputed at every
rebalance), so its traffic does not grow with the number of hosts, and a
bad decision is dead-lettered by one actuator, not by all. With ``all`` it
reads every partition and skips other hosts' decisions (for decisions
produced by a client with another partitioner).

Stops cleanly on SIGTERM / SIGINT (finishes the batch in hand, flushes,
commits, leaves the group), also while it waits for an unreachable broker,
which it reports in one line every few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from phasewise.actuators.backends import Backend, CgroupBackend, DryRunBackend, JobSetupError, job_runtime
from phasewise.actuators.commands import Outcome, SetLimits, StartJob
from phasewise.actuators.ledger import Ledger, ledger_path
from phasewise.actuators.ledger_loss import verify_ledger
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
from phasewise.kit.job_signing import JobSigningError, SubmitterKeys, trusted_submitters
from phasewise.kit.records import (
    JOB_ID_PATTERN,
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
from phasewise.kit.signing import Keyring, SigningError, keyring_of
from phasewise.kit.statedir import StateDirError, ensure_state_dir
from phasewise.kit.topics import ACTUATIONS, DECISIONS, JOB_EVENTS
from phasewise.models.safety.workload import resolve

__all__ = ["Actuator", "add_arguments", "group_id", "make_backend", "run", "run_actuator", "serve", "submitters_of"]

log = logging.getLogger("phasewise.actuator")


class _Produces(Protocol):
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, **kw: Any) -> None: ...

    def poll(self, timeout: float = ...) -> int: ...


def group_id(host: str) -> str:
    return f"phasewise-actuator-{host}"


#: a place decision's refusal while ``actuator_start_jobs`` is off
NOT_STARTING = "this actuator does not start jobs (actuator_start_jobs is off)"
#: the actions that touch a job's container: taken only on a container the actuator owns for that job
OWNED_ACTIONS = ("freeze", "thaw", "terminate", "weight")
_JOB_ID = re.compile(JOB_ID_PATTERN)


def job_of(d: Decision) -> str:
    """The job a decision is about: ``details.job`` where it names one, else its container."""
    job = d.details.get("job") if isinstance(d.details, dict) else None
    return job if isinstance(job, str) and job else d.container


def touches_a_job(d: Decision) -> bool:
    """Whether *d* acts on a job's existing container (freeze, thaw, terminate, weight, resume)."""
    resume = isinstance(d.details, dict) and d.details.get("resume") is True
    return d.action in OWNED_ACTIONS or (d.action == "place" and resume)


class Actuator:
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
        if hasattr(backend, "on_fallback"):
            backend.on_fallback = lambda outcome: self.metrics.resize_fallbacks.labels(outcome=outcome).inc()

    # ------------------------------------------------------------------ one message

    def handle(self, decision_bytes: bytes | None, key: bytes | None, partition: int | None,
               offset: int | None, *, topic: str = DECISIONS.name, headers: Any = None,
               produced_at: float | None = None) -> Actuation | None:
        """Handle one message; returns the published Actuation, or ``None`` (dead-lettered / other host).

        *headers*: the message's Kafka headers (its signature, checked when a keyring is set).
        *produced_at*: the record's Kafka timestamp (s), for the decision-to-actuation latency.
        """
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
        exists = is_managed_name(d.container) and self.backend.exists(d.container)
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
                 terminated=terminated, submitters=self._trusted() if d.action == "place" else None,
                 owned_by=self._owner(d.container, workload) if d.action == "place" and exists else None)
        if not isinstance(p, Planned):
            return Outcome("rejected", p.reason)
        if isinstance(p.command, StartJob) and not p.command.job:
            p = Planned(dataclasses.replace(p.command, job=job_of(d)), p.notes)
        out = self._apply_with_retries(p)
        watched = getattr(self.backend, "watched", None)
        if watched is not None and isinstance(p.command, SetLimits):
            if d.container in watched:
                self._resizes[d.container] = d
            else:
                self._resizes.pop(d.container, None)
        if out.status != "applied":
            return out
        if d.action == "terminate":
            self.ledger.record_termination(d.container, d.id, self.clock())
            self.record_exits()  # its process's exit status, where this actuator started it
            self.ledger.record_end(d.container, now=self.clock())  # ended either way (the container is empty)
        elif d.action == "place":  # a new job in the container: it may be terminated again
            self.ledger.forget_termination(d.container)
            self._started(d, p.command, out)
        msg = "; ".join(m for m in (p.message, out.message) if m)
        return Outcome(p.status, msg, out.cpu_cores, out.mem_bytes, pid=out.pid)

    def _started(self, d: Decision, cmd: Any, out: Outcome) -> None:
        """Enter a job this actuator started in its registry and announce it (a ``started`` job event).

        A dry run's start is entered (for the dry run's own later decisions) but not announced:
        no process runs.
        """
        job = cmd.job if isinstance(cmd, StartJob) and cmd.job else job_of(d)
        digest = d.details.get("spec_digest") if isinstance(d.details, dict) else None
        self.ledger.record_start(d.container, job=job, decision=d.id, backend=self.backend.name, pid=out.pid,
                                 spec_digest=digest if isinstance(digest, str) else "", now=self.clock())
        if out.pid is None or not _JOB_ID.match(job):
            return
        details = d.details if isinstance(d.details, dict) else {}
        workload, priority = details.get("workload"), details.get("priority")
        ev = JobEvent(job=job, ts=self.clock(), kind="started", host=self.settings.host, container=d.container,
                      pid=out.pid,
                      workload=workload if workload in ("training", "inference", "interactive") else "training",
                      priority=priority if isinstance(priority, int) and not isinstance(priority, bool)
                      and abs(priority) <= 10**9 else 0)
        key, value = job.encode(), encode(ev)
        headers = None if self.keyring is None else self.keyring.headers(JOB_EVENTS.name, key, value)
        self.producer.produce(JOB_EVENTS.name, key=key, value=value, headers=headers)
        self.producer.poll(0)

    def record_exits(self) -> int:
        """Enter in the registry the jobs the backend saw exit (their end and exit status); how many."""
        exited = getattr(self.backend, "exited", None)
        if exited is None:
            return 0
        n = 0
        for e in exited():
            n += self.ledger.record_end(e.container, pid=e.pid, exit_status=e.returncode, now=self.clock())
        return n

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
        for attempt in range(attempts):
            try:
                out = self.backend.apply(p.command)
            except Exception as e:  # a backend bug must not lose the decision's report
                log.exception("backend %s raised on %r", self.backend.name, p.command)
                out = Outcome.failed(f"backend {self.backend.name} raised {type(e).__name__}: {e}")
            if out.status != "failed" or not out.temporary:
                break
            if attempt + 1 == attempts:
                out = Outcome.failed(f"{out.message} (temporary error; gave up after {attempts} attempts)",
                                     temporary=True, cpu_cores=out.cpu_cores, mem_bytes=out.mem_bytes)
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


# --------------------------------------------------------------------------- the loop


def record_time(m: Any) -> float | None:
    """A consumed record's Kafka timestamp in seconds (None where the record has none)."""
    from confluent_kafka import TIMESTAMP_NOT_AVAILABLE

    kind, ms = m.timestamp()
    return None if kind == TIMESTAMP_NOT_AVAILABLE or ms is None or ms <= 0 else ms / 1000.0


def own_partition(consumer: Any, key: bytes, topic: str = DECISIONS.name) -> Callable[[Any, list], None]:
    """An ``on_assign`` callback that keeps, of the partitions the group assigns, the one holding *key*.

    The partition is :func:`phasewise.kit.kafka.partitions.partition_for` over the
    topic's partition count, read from the broker at each assignment (a topic
    that grew partitions moves the key, and the group rebalances). A second
    actuator of the same host (a rolling update) joins the same group: the
    partition is assigned to one of them, which alone reads it.
    """
    from phasewise.kit.kafka.partitions import partition_for

    def on_assign(c: Any, partitions: list) -> None:
        md = consumer.list_topics(topic, timeout=10).topics.get(topic)
        n = len(md.partitions) if md is not None and md.partitions else 0
        mine = partition_for(key, n) if n else None
        keep = [tp for tp in partitions if tp.topic == topic and tp.partition == mine]
        consumer.assign(keep)
        log.info("assigned %s; reading %s (partition of key %r among %d)",
                 sorted(tp.partition for tp in partitions),
                 f"partition {mine}" if keep else "nothing (another member of the group has it)", key, n)

    return on_assign


def serve(actuator: Actuator, consumer: Any, producer: Any, stop: threading.Event, *,
          batch: int = 100, poll_s: float = 0.5, only_key: bytes | None = None, health: Any = None) -> None:
    """Consume decisions until *stop* is set: handle, flush, then commit.

    Every message is handled (a malformed one is dead-lettered); only an error
    that is not about a message (ledger, backend, Kafka) ends the loop, after
    the offsets of the messages handled so far were committed. *only_key*: read
    only the partition records with this key go to (:func:`own_partition`).
    """
    from confluent_kafka import KafkaException

    if only_key is None:
        consumer.subscribe([DECISIONS.name])
    else:
        consumer.subscribe([DECISIONS.name], on_assign=own_partition(consumer, only_key))
    # a terminate waits out its grace (at most terminate_grace_max_s) and then its processes' end: a
    # message may take that long, and the loop is live while it does
    live_s = max(30.0, 10 * poll_s) + actuator.settings.actuator.terminate_grace_max_s
    while not stop.is_set():
        if health is not None:
            health.beat("consume", live_s)
        actuator.follow_up()  # watched resizes (update-mode in-place-or-recreate) due a check
        actuator.record_exits()  # the jobs it started that ended, into its registry
        # block for the first decision only, then take what is already there:
        # consume(n, timeout) alone would wait the whole timeout for n messages
        first = consumer.poll(poll_s)
        if first is None:
            continue
        msgs = [first, *consumer.consume(batch - 1, 0)]
        offsets: dict[tuple[str, int], int] = {}  # past the messages handled (applied, reported or dead-lettered)
        try:
            for m in msgs:
                if health is not None:
                    health.beat("consume", live_s)
                err = m.error()
                if err is not None:
                    if err.fatal():
                        raise KafkaException(err)
                    log.warning("consumer error on %s[%s]: %s", m.topic(), m.partition(), err)
                    continue
                actuator.handle(m.value(), m.key(), m.partition(), m.offset(), topic=m.topic(),
                                headers=m.headers(), produced_at=record_time(m))
                offsets[(m.topic(), m.partition())] = m.offset() + 1
        except BaseException:
            # not a record (those are dead-lettered): the ledger, the backend or Kafka failed. The
            # messages handled so far are committed, the rest is redelivered to the next actuator.
            _commit_handled(consumer, producer, offsets, stop)
            raise
        _commit_handled(consumer, producer, offsets, stop)


#: seconds a batch's actuations get to be delivered before its offsets are left uncommitted
COMMIT_FLUSH_S = 30.0


def _commit_handled(consumer: Any, producer: Any, offsets: dict[tuple[str, int], int],
                    stop: threading.Event | None = None) -> None:
    """Commit *offsets* once every actuation and dead letter produced so far is delivered.

    Waits up to :data:`COMMIT_FLUSH_S`, in short slices so that a stop asked
    for meanwhile (the broker gone, SIGTERM) ends the wait at once: the batch
    is then not committed, and its redelivery is answered by the ledger.
    """
    from confluent_kafka import KafkaException, TopicPartition

    deadline = time.monotonic() + COMMIT_FLUSH_S
    while True:
        left = producer.flush(max(0.0, min(0.5, deadline - time.monotonic())))
        if not left or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            break
    if left:
        # not committing: the batch is redelivered and the ledger reports it as duplicates
        log.error("%d actuation/dead-letter messages undelivered%s; offsets not committed", left,
                  " at stop" if stop is not None and stop.is_set() else f" after {COMMIT_FLUSH_S:g} s")
        return
    if offsets:
        try:
            consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                            asynchronous=False)
        except KafkaException as e:
            log.warning("offset commit failed (the ledger covers redelivery): %s", e)


def make_backend(settings: Settings) -> Backend:
    """The backend the settings name.

    Dry-run, when the cgroup tree is there, reads real memory usage and whether
    a container exists from it (a missing one is rejected, as the cgroup
    backend rejects it); without a tree, every container with a managed name
    counts as existing, and the start-up line says so.
    """
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.cgroups.workloads import layout_from_settings

    a = settings.actuator
    if a.backend == "cgroup":
        # JobSetupError: a job user this host cannot switch to (checked at start-up, not at the first job)
        jobs = job_runtime(settings) if a.start_jobs else None
        return CgroupBackend(layout_from_settings(settings), jobs=jobs)
    if settings.actuator.backend == "kubernetes":
        from phasewise.actuators.backends.kubernetes import KubeApi, KubernetesBackend, PodDirectory, RecreatePolicy

        url = settings.actuator.kube_api
        api = KubeApi(url) if url else KubeApi.in_cluster()  # ValueError: not in a cluster, bad URL
        # the node's cgroup tree (CgroupError without one): a container is acted on only where it is
        # discovered there, so the per-workload mode is resolved from its real identity
        layout = layout_from_settings(settings)
        return KubernetesBackend(api, PodDirectory(api, settings.host), present=layout.exists,
                                 recreate=RecreatePolicy(deferred_timeout_s=a.kube_resize_deferred_timeout_s,
                                                         in_progress_timeout_s=a.kube_resize_in_progress_timeout_s,
                                                         check_s=a.kube_resize_check_s))
    jobs = job_runtime(settings, switches=False) if a.start_jobs else None  # described, never switched to
    try:
        real = CgroupBackend(layout_from_settings(settings))
    except CgroupError as e:
        log.info("dry run without a cgroup tree (%s): memory usage unknown, every well-named container "
                 "counts as existing", e)
        return DryRunBackend(jobs=jobs)
    return DryRunBackend(usage=real.memory_usage, exists=real.exists, jobs=jobs)


#: seconds a stopping actuator waits for its last messages' delivery
FINAL_FLUSH_S = 3.0


def run_actuator(settings: Settings, backend: Backend, stop: threading.Event, *,
                 metrics: ActuatorMetrics | None = None, ledger: Ledger | None = None,
                 host_cores: float | None = None, workloads: Any = None,
                 keyring: Keyring | None = None, health: Any = None,
                 submitters: SubmitterKeys | None = None) -> None:
    """Build the Kafka clients and ledger, then :func:`serve` until *stop* is set.

    With ``create_topics``, first waits for the broker (saying so every few
    seconds) or for *stop*. At the end, actuations not yet delivered get
    :data:`FINAL_FLUSH_S` and are counted in the log if still undelivered.
    """
    from phasewise.kit.kafka.client import ensure_topics, make_consumer, make_producer, wait_for_broker

    if settings.kafka.create_topics:
        if not wait_for_broker(settings, None, stop=stop):
            return
        ensure_topics(settings)
    own_ledger = ledger is None
    if ledger is None:
        ledger = Ledger(ledger_path(settings.data_dir, settings.host),
                        max_age_s=settings.actuator.ledger_max_age_days * 86400,
                        max_rows=settings.actuator.ledger_max_rows)
    producer = make_producer(settings, on_delivery=_delivery_report)
    if keyring is None:
        keyring = keyring_of(settings)
    if submitters is None:
        submitters = submitters_of(settings)
    actuator = Actuator(settings, backend, ledger, producer, metrics=metrics, host_cores=host_cores,
                        workloads=workloads, keyring=keyring, submitters=submitters)
    consumer = make_consumer(settings, group_id(settings.host), **lag_statistics(actuator.metrics))
    only = settings.host.encode() if settings.actuator.read_partitions == "host" else None
    try:
        # a new ledger that replaces a lost one is restored before anything is applied
        if not verify_ledger(settings, ledger, consumer, actuator.metrics, stop, group=group_id(settings.host)):
            return
        serve(actuator, consumer, producer, stop, only_key=only, health=health)
    finally:
        consumer.close()
        left = producer.flush(FINAL_FLUSH_S)
        if left:
            # their decisions' offsets were not committed: they come again and the ledger answers "duplicate"
            log.error("stopping with %d actuation/dead-letter message(s) undelivered after %g s", left,
                      FINAL_FLUSH_S)
        if own_ledger:
            ledger.close()


def submitters_of(settings: Settings) -> SubmitterKeys | None:
    """The keys ``job_trusted_submitters`` names (``None``: it is empty); :class:`JobSigningError` (one line)."""
    return trusted_submitters(settings.jobs.trusted_submitters)


def lag_statistics(metrics: ActuatorMetrics, every_ms: int = 5000) -> dict[str, Any]:
    """Consumer options that keep ``phasewise_actuator_consumer_lag{topic}`` current (librdkafka statistics)."""
    from phasewise.kit.kafka.client import lag_by_topic

    def on_stats(doc: str) -> None:
        try:
            lags = lag_by_topic(doc)
        except ValueError:
            return
        for topic, lag in lags.items():
            if topic == DECISIONS.name:  # the one topic this consumer reads: a bounded label
                metrics.consumer_lag.labels(topic=topic).set(lag)

    return {"statistics.interval.ms": every_ms, "stats_cb": on_stats}


def _delivery_report(err: Any, msg: Any) -> None:
    if err is not None:
        log.error("could not deliver to %s: %s", msg.topic(), err)


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    from phasewise.kit.command import add_common, add_setting

    add_common(p)
    for name in ("backend", "kube_api", "cgroup_root", "cgroup_prefix", "cgroup_layout", "cgroup_parent",
                 "cpu_floor_cores", "mem_margin_bytes", "mem_floor_bytes", "metrics_port", "data_dir",
                 "workload_default_mode", "workload_policy_file", "workload_pods", "terminate_grace_s",
                 "terminate_grace_max_s", "cpu_weight_min", "cpu_weight_max", "actuator_start_jobs", "job_user",
                 "job_group", "job_trusted_submitters", "job_spec_max_age_s", "job_allowed_commands"):
        add_setting(p, name, help={"data_dir": "where the ledger of applied decisions lives"}.get(name))


def run(args: argparse.Namespace) -> int:
    from phasewise.kit.cgroups.fs import CgroupError
    from phasewise.kit.cgroups.workloads import layout_from_settings, workloads_from_settings
    from phasewise.kit.command import settings_from_args, stop_on_signals
    from phasewise.models.safety.workload import WorkloadError

    settings = settings_from_args(args)
    try:
        keyring = keyring_of(settings)
        submitters = submitters_of(settings)
    except (SigningError, JobSigningError) as e:
        print(f"phasewise actuate: error: {e}", file=sys.stderr)
        return 2
    if settings.actuator.start_jobs and submitters is None:
        print("phasewise actuate: error: actuator_start_jobs is on but job_trusted_submitters is empty: "
              "name the public keys of the submitters whose signed jobs this actuator may start "
              "(phasewise keys submitter PATH writes a pair)", file=sys.stderr)
        return 2
    try:
        # 0711: the jobs it starts, as job_user, reach their working directories below it; list nothing
        ensure_state_dir(settings.data_dir, mode=0o711)
    except StateDirError as e:
        print(f"phasewise actuate: error: data_dir: {e}", file=sys.stderr)
        return 2
    try:
        backend = make_backend(settings)
    except JobSetupError as e:
        print(f"phasewise actuate: error: {e}", file=sys.stderr)
        return 2
    except CgroupError as e:
        print(f"phasewise actuate: error: cgroup_root: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the kubernetes backend's configuration
        print(f"phasewise actuate: error: kube_api: {e}", file=sys.stderr)
        return 2
    try:
        workloads = workloads_from_settings(settings, layout_from_settings(settings))
    except CgroupError:
        workloads = None  # dry run without a cgroup tree: the default mode decides
    except WorkloadError as e:
        print(f"phasewise actuate: error: workload_policy_file: {e}", file=sys.stderr)
        return 2
    print(settings.describe(), flush=True)
    jobs = getattr(backend, "jobs", None)
    if jobs is not None:
        starts = f"{'would start' if backend.name == 'dry-run' else 'starts'} jobs as {jobs.who()} in {jobs.work_root}"
    else:
        starts = "starts no jobs" + (" (actuator_start_jobs is off)" if backend.name != "kubernetes" else "")
    print(f"actuator: backend={backend.name} group={group_id(settings.host)} "
          f"ledger={ledger_path(settings.data_dir, settings.host)} host_cores={os.cpu_count()} {starts}", flush=True)
    if settings.actuator.start_jobs and submitters is not None:
        print("actuator: starts the jobs signed by the trusted submitter keys " + submitters.describe(), flush=True)

    metrics = ActuatorMetrics()
    from phasewise.kit.kafka.client import kafka_log
    from phasewise.kit.observe import Health

    klog = kafka_log(settings.kafka.bootstrap)

    def not_ready() -> str | None:
        if health.since("consume") is None:
            return f"waiting for the broker at {settings.kafka.bootstrap}"
        why = klog.outage()
        if why is not None:
            return f"no Kafka broker answers at {settings.kafka.bootstrap} ({why})"
        return None

    #: live while the consume loop turns (or the wait for the broker does); ready while consuming
    health = Health(ready=not_ready)
    health.beat("start", 1e9)  # the wait for the broker at start-up may last: live, not ready
    if settings.metrics_port:
        from phasewise.kit.observe import serve as serve_http

        serve_http(metrics.registry, settings.metrics_port, health, settings.bind_address)
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", settings.bind_address,
                 settings.metrics_port)

    stop = threading.Event()
    try:
        with stop_on_signals(stop) as received:
            run_actuator(settings, backend, stop, metrics=metrics, workloads=workloads, keyring=keyring, health=health,
                         submitters=submitters)
    except Exception:
        log.critical("actuator failed; exiting with status 1 (unhandled messages are redelivered)", exc_info=True)
        return 1
    if received:
        log.info("%s: stopped", signal.Signals(received[0]).name)
    log.info("actuator stopped")
    return 0
