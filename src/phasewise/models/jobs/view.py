"""The job view, pure: each job's state, where it runs, its prediction against what it used, its progress
against its targets and, while it waits, why — folded from the records the roles publish.

:class:`JobsFold` takes job events, decisions, actuations, predictions, dead letters and host samples in
any order (samples are joined with the ``started`` events folded before them) and :meth:`JobsFold.views`
orders each job's records by event time and walks the lifecycle of docs/jobs.md: a state after a terminal
one, or repeated, changes nothing and is marked ignored in the job's timeline. ``phasewise jobs`` prints
it (:mod:`phasewise.apps.jobs`); narrative: docs/jobs.md, "Watching jobs".

>>> from phasewise.kit.records import JobEvent, JobSpec
>>> f = JobsFold(ViewConfig(warmup_s=0.0, prediction_wait_s=10.0))
>>> f.job_event(JobEvent(job="a", ts=1.0, kind="submitted", spec=JobSpec(model="mlp", dataset="mnist",
...                                                                       batch_size=8)))
>>> f.job_event(JobEvent(job="a", ts=5.0, kind="started", host="h1", container="a", pid=42))
>>> v = f.views(now=6.0)[0]
>>> v.state, v.host, v.pid
('running', 'h1', 42)
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from phasewise.kit.records import (
    TERMINAL_KINDS,
    Actuation,
    DeadLetter,
    Decision,
    HostSamples,
    JobEvent,
    UtilisationPrediction,
)
from phasewise.models.jobs.lifecycle import STOP_EXITS
from phasewise.models.jobs.targets import passed

__all__ = ["STATES", "TARGETS", "Entry", "JobView", "JobsFold", "ViewConfig"]

#: a job's states in the view: before it runs, while it runs, how it ended (docs/jobs.md, "Watching jobs");
#: ``unknown``: records name the job but no ``submitted`` event or state was seen
STATES = ("waiting", "placed", "running", "frozen", "finished", "failed", "terminated", "rejected", "lost",
          "unknown")
#: what Horus predicts and the samples show, per job: the prediction's field and the sample's
TARGETS = ("cpu_cores", "mem_bytes", "gpu_util", "gpu_mem_bytes")

#: the job-event kinds that move a job to a state (the others: progress, priority, and the hints below)
_STATE_OF = {"started": "running", "frozen": "frozen", "thawed": "running", "finished": "finished",
             "failed": "failed", "terminated": "terminated", "rejected": "rejected", "lost": "lost"}
#: the order of records with one event time: the life of a job as the roles write it
_ORDER = {"submitted": 0, "prediction": 1, "admitted": 2, "place": 3, "started": 4}


@dataclass(frozen=True, slots=True)
class ViewConfig:
    """From the settings, which hold the defaults (docs/architecture.md, "Defaults")."""

    warmup_s: float  #: seconds after a job's start left out of what it used (``horus_warmup_s``, as Horus does)
    prediction_wait_s: float  #: how long placement waits for a prediction (``place_prediction_wait_s``)


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a job's timeline: a record about it."""

    ts: float  #: the record's event time
    source: str  #: the topic, short: job-events, decisions, actuations, predictions, deadletters
    kind: str  #: the event's kind, the decision's action, the actuation's status, "prediction", "dead letter"
    text: str  #: what it says, in words
    ignored: str | None = None  #: why it changed nothing (a state after the job ended, a repeat)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the records tell it (``phasewise jobs``, one row; ``describe``: all of it)."""

    job: str
    state: str  #: one of :data:`STATES`
    since: float | None  #: event time it entered *state*
    submitted: float | None  #: event time of its ``submitted`` event (None: not seen)
    workload: str  #: its class: training, inference, interactive
    priority: int
    host: str | None = None
    node: str | None = None  #: the placement's node where it is not the host (a cpuset slice)
    container: str | None = None
    pid: int | None = None
    cpuset: str | None = None
    gpus: tuple[str, ...] = ()
    spec: dict[str, Any] | None = None  #: model, dataset, batch_size, requests
    reason: str | None = None  #: why it waits, or why it ended (rejected, failed, lost, terminated)
    exit_code: int | None = None
    signal: str | None = None
    oom: bool = False
    run_s: float | None = None
    prediction: dict[str, Any] | None = None  #: the latest: ts, model_version, first_sight, target -> mean, lo, hi
    observed: dict[str, Any] | None = None  #: samples (count), since (ts of the first), target -> mean
    progress: dict[str, Any] | None = None  #: the latest progress: ts, step, epoch, metric, value
    targets: dict[str, Any] | None = None  #: metric, direction, acceptable, objective, reached
    decisions: tuple[str, ...] = ()  #: ids of the decisions about it, in order
    timeline: tuple[Entry, ...] = ()

    def to_dict(self, *, timeline: bool = True) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "timeline"}
        d["gpus"] = list(self.gpus)
        d["decisions"] = list(self.decisions)
        if timeline:
            d["timeline"] = [e.to_dict() for e in self.timeline]
        return d


@dataclass(slots=True)
class _Job:
    """What the fold keeps of one job until :meth:`JobsFold.views`."""

    #: (ts, order, seq, source, record, why it is refused or None)
    records: list[tuple[float, int, int, str, Any, str | None]] = field(default_factory=list)
    runs: list[list[Any]] = field(default_factory=list)  # [host, container, started ts] per start
    ends: list[float] = field(default_factory=list)  # event times of the states that ended a run
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    first_sample: float | None = None
    last_sample: float | None = None
    decision_ids: set[str] = field(default_factory=set)


class JobsFold:
    """Records in (any order, any number of times), :meth:`views` out."""

    def __init__(self, config: ViewConfig, *, job_topics: frozenset[str] = frozenset()) -> None:
        self.config = config
        #: the topics keyed by job id (job events, predictions, control): a dead letter of theirs is its key's
        self.job_topics = job_topics
        self._jobs: dict[str, _Job] = {}
        self._where: dict[tuple[str, str], str] = {}  # (host, container) -> job, from started events
        self._by_container: dict[str, str] = {}  # container -> job, from started events and place decisions
        self._decision_job: dict[str, str] = {}  # decision id -> job
        self._seq = 0

    def _add(self, job: str, ts: float, order: int, source: str, record: Any, refused: str | None = None) -> _Job:
        j = self._jobs.setdefault(job, _Job())
        self._seq += 1
        j.records.append((ts, order, self._seq, source, record, refused))
        return j

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def hosts(self) -> set[str]:
        """The hosts the folded ``started`` events name (the only samples :meth:`samples` takes)."""
        return {host for host, _container in self._where}

    def first_start(self) -> float | None:
        """The earliest ``started`` event time folded (samples before it belong to no job)."""
        return min((r[2] for j in self._jobs.values() for r in j.runs), default=None)

    # -- the records ------------------------------------------------------------------------------------

    def job_event(self, ev: JobEvent, refused: str | None = None) -> None:
        """A job event; *refused*: why it does not count (e.g. a state not signed with the cluster key): it is
        in the timeline, marked, and changes nothing."""
        j = self._add(ev.job, ev.ts, _ORDER.get(ev.kind, 5), "job-events", ev, refused)
        if refused is not None:
            return
        if ev.kind == "started" and ev.host is not None:
            container = ev.container or ev.job
            j.runs.append([ev.host, container, ev.ts])
            self._where[(ev.host, container)] = ev.job
            self._by_container[container] = ev.job
        elif ev.kind in ("finished", "failed", "terminated", "lost", "rejected"):
            j.ends.append(ev.ts)  # its container's samples after this are not the job's use

    def _job_of(self, host: str, container: str, details: dict | None = None) -> str | None:
        job = (details or {}).get("job")
        if isinstance(job, str) and job:
            return job
        return self._where.get((host, container)) or self._by_container.get(container) or (
            container if container in self._jobs else None)

    def decision(self, d: Decision, refused: str | None = None) -> None:
        """A decision about a job: its ``details.job``, or the container of a job (*refused*: as for
        :meth:`job_event`)."""
        job = self._job_of(d.host, d.container, d.details)
        if job is None:
            return  # a container no job runs in (a VPA or phase decision)
        j = self._add(job, d.ts, _ORDER.get(d.action, 5), "decisions", d, refused)
        j.decision_ids.add(d.id)
        self._decision_job[d.id] = job
        if d.action == "place":
            self._by_container.setdefault(d.container, job)

    def actuation(self, a: Actuation) -> None:
        """What an actuator did with a decision about a job (matched by the decision's id, else container)."""
        job = self._decision_job.get(a.decision_id) or self._job_of(a.host, a.container)
        if job is not None:
            self._add(job, a.ts, 6, "actuations", a)

    def prediction(self, p: UtilisationPrediction, refused: str | None = None) -> None:
        self._add(p.job, p.ts, _ORDER["prediction"], "predictions", p, refused)

    def dead_letter(self, dl: DeadLetter) -> None:
        """A dead letter about a job: keyed by it (job-keyed topics), or its payload naming it."""
        job = None
        if dl.source_topic in self.job_topics and dl.key:
            job = dl.key
        if job is None and not dl.truncated:
            try:
                obj = json.loads(dl.payload)
            except (ValueError, RecursionError):  # not JSON, or nested too deep to read
                obj = None
            if isinstance(obj, dict):
                named = obj.get("job")
                if isinstance(named, str) and named:
                    job = named
                elif isinstance(obj.get("host"), str) and isinstance(obj.get("container"), str):
                    details = obj.get("details") if isinstance(obj.get("details"), dict) else None
                    job = self._job_of(obj["host"], obj["container"], details)
        if job is not None and job in self._jobs:  # (a job the fold knows: job events first)
            self._add(job, dl.ts, 7, "deadletters", dl)

    def samples(self, hs: HostSamples) -> None:
        """What a job's containers used (the ``started`` events folded before say which containers)."""
        if not self._where:
            return
        for cs in hs.containers:
            job = self._where.get((hs.host, cs.container))
            if job is None:
                continue
            j = self._jobs[job]
            run = next((r for r in reversed(j.runs) if r[0] == hs.host and r[1] == cs.container), None)
            if run is None or hs.ts < run[2] + self.config.warmup_s:
                continue  # its loading phase, left out as Horus leaves it out
            end = min((e for e in j.ends if e >= run[2]), default=None)
            if end is not None and hs.ts - hs.interval_s >= end:
                continue  # sampled after the run ended (the cgroup stays, empty)
            j.samples += 1
            j.first_sample = hs.ts if j.first_sample is None else min(j.first_sample, hs.ts)
            j.last_sample = hs.ts if j.last_sample is None else max(j.last_sample, hs.ts)
            for name in TARGETS:
                v = getattr(cs, name)
                if v is not None:
                    j.sums[name] = j.sums.get(name, 0.0) + float(v)
                    j.counts[name] = j.counts.get(name, 0) + 1

    # -- the view ---------------------------------------------------------------------------------------

    def views(self, now: float) -> list[JobView]:
        """Every job, by submission time (then id); *now*: the wall clock, for the reason of a wait. A waiting
        job's reason ends with its place among the waiting jobs in placement's order (priority, then
        submission)."""
        out = [_Walk(job, j, self.config).view(now) for job, j in self._jobs.items()]
        waiting = sorted((v for v in out if v.state == "waiting"),
                         key=lambda v: (-v.priority, v.submitted if v.submitted is not None else now, v.job))
        rank = {v.job: i + 1 for i, v in enumerate(waiting)}
        out = [dataclasses.replace(v, reason=f"{v.reason}; {_ordinal(rank[v.job])} of {len(waiting)} waiting "
                                                f"jobs by priority, then submission")
               if v.job in rank and len(waiting) > 1 else v for v in out]
        return sorted(out, key=lambda v: (v.submitted if v.submitted is not None else float("inf"), v.job))

    def view(self, job: str, now: float) -> JobView | None:
        """One job's view (None: no record names it)."""
        return next((v for v in self.views(now) if v.job == job), None) if job in self._jobs else None


class _Walk:
    """One job's records in event-time order, walked through the lifecycle."""

    def __init__(self, job: str, j: _Job, config: ViewConfig) -> None:
        self.job, self.j, self.config = job, j, config

    def view(self, now: float) -> JobView:  # noqa: C901 - one walk, one place
        job, j = self.job, self.j
        state: str | None = None
        since: float | None = None
        s: dict[str, Any] = {"host": None, "node": None, "container": None, "pid": None, "cpuset": None,
                             "gpus": (), "reason": None, "exit_code": None, "signal": None, "oom": False,
                             "run_s": None}
        submitted: JobEvent | None = None
        priority, workload = 0, "training"
        prediction: UtilisationPrediction | None = None
        progress: JobEvent | None = None
        decisions: list[str] = []
        letters: list[DeadLetter] = []  # since it last changed state
        hint: str | None = None  # the priority agent's word on a waiting job
        stopped = False  # the priority agent stopped it since it last started (to resume it)
        stopping = False  # a checkpoint stop's terminate decision was made since it last started
        timeline: list[Entry] = []

        def enter(new: str, ts: float) -> None:
            nonlocal state, since, letters, hint
            if new != state:
                state, since = new, ts
                letters = []
            if new != "waiting":
                hint = None

        for ts, _o, _seq, source, r, refused in sorted(j.records, key=lambda x: x[:3]):
            ignored: str | None = None
            if refused is not None:
                timeline.append(_entry(ts, source, r, refused))
                continue
            if source == "job-events":
                ev: JobEvent = r
                text = _event_text(ev)
                if state in TERMINAL_KINDS and ev.kind not in ("progress", "priority"):
                    ignored = f"after {state}"
                elif ev.kind == "submitted":
                    if submitted is not None:
                        ignored = "submitted again"
                    else:
                        submitted, priority, workload = ev, ev.priority, ev.workload
                        if state is None:
                            enter("waiting", ts)
                elif ev.kind == "admitted":
                    if state in (None, "waiting", "terminated"):
                        enter("waiting", ts)
                        hint = (f"admitted on {ev.host}{' (resume)' if ev.resume else ''} by the priority agent "
                                f"at {_clock(ts)}; no place decision since")
                    else:
                        ignored = f"while {state}"
                elif ev.kind == "stopped":
                    if state in ("running", "placed", "frozen", "waiting", None):
                        enter("waiting", ts)
                        stopped = True
                        hint = "stopped by the priority agent (checkpoint and exit); waits to be admitted again"
                    else:
                        ignored = f"while {state}"
                elif ev.kind == "waiting":  # the placement agent's word on why no node takes it
                    if state in (None, "waiting"):
                        enter("waiting", ts)
                        hint = f"placement at {_clock(ts)}: {ev.reason or 'no node takes it'}"
                    else:
                        ignored = f"while {state}"
                elif ev.kind == "progress":
                    if progress is None or ts >= progress.ts:
                        progress = ev
                    else:
                        ignored = "older than the latest progress"
                elif ev.kind == "priority":
                    priority = ev.priority
                elif ev.kind in _STATE_OF:
                    new = _STATE_OF[ev.kind]
                    if ev.kind in STOP_EXITS and (stopped and state == "waiting"
                                               or stopping and state in ("running", "frozen")):
                        # the exit of the priority agent's own stop (known from its stopped hint or its terminate
                        # decision; finished or failed where the job honoured the stop's control before the
                        # actuator handled the terminate): the job waits to be resumed
                        enter("waiting", ts)
                        s.update(exit_code=ev.exit_code, signal=ev.signal, run_s=ev.run_s)
                        hint = ("stopped by the priority agent (checkpoint and exit), ended"
                                + (f" ({ev.reason})" if ev.reason else "") + "; waits to be admitted again")
                    elif ev.kind == "thawed" and state != "frozen":
                        ignored = f"while {state or 'unknown'} (not frozen)"
                    elif ev.kind == "frozen" and state not in ("running", "placed"):
                        ignored = f"while {state or 'unknown'}"
                    elif state == new and ev.kind != "started":
                        ignored = f"already {state}"
                    else:
                        enter(new, ts)
                        if ev.kind == "started":
                            stopped = stopping = False
                            s.update(host=ev.host, container=ev.container or job, pid=ev.pid,
                                     cpuset=ev.cpuset or s["cpuset"], gpus=tuple(ev.devices) or s["gpus"],
                                     reason=None, exit_code=None, signal=None, oom=False, run_s=None)
                        if ev.kind in ("finished", "failed", "terminated", "rejected", "lost"):
                            s.update(reason=ev.reason, exit_code=ev.exit_code, signal=ev.signal, oom=ev.oom,
                                     run_s=ev.run_s)
                        if ev.kind == "rejected" and ev.host:
                            s["host"] = ev.host
                timeline.append(Entry(ts, source, ev.kind, text, ignored))
            elif source == "decisions":
                d: Decision = r
                decisions.append(d.id)
                if d.is_checkpoint_stop:
                    stopping = True
                if d.action == "place":
                    if state in (None, "waiting", "terminated"):
                        node = d.details.get("node")
                        gpus = d.details.get("gpus") or ()
                        cpuset = d.details.get("cpuset")
                        enter("placed", ts)
                        s.update(host=d.host, node=node if isinstance(node, str) and node != d.host else None,
                                 container=d.container, cpuset=cpuset if isinstance(cpuset, str) and cpuset else None,
                                 gpus=tuple(str(g) for g in gpus) if isinstance(gpus, list) else (), pid=None,
                                 reason=None)
                    else:
                        ignored = f"while {state}"
                timeline.append(Entry(ts, source, d.action, _decision_text(d), ignored))
            elif source == "actuations":
                a: Actuation = r
                timeline.append(Entry(ts, source, a.status, f"{a.backend} on {a.host}: decision {a.decision_id}"
                                      + (f": {a.message}" if a.message else "")))
            elif source == "predictions":
                p: UtilisationPrediction = r
                if prediction is None or ts >= prediction.ts:
                    prediction = p
                timeline.append(Entry(ts, source, "prediction", _prediction_text(p)))
            elif source == "deadletters":
                dl: DeadLetter = r
                letters.append(dl)
                timeline.append(Entry(ts, source, "dead letter",
                                      f"a record of {dl.source_topic} refused: {dl.reason}"))

        reason = s["reason"]
        if state == "waiting":
            reason = self._why_waiting(now, submitted, prediction,
                                       [dl for dl in letters if _about_submission(dl, submitted)], hint)
        elif state == "placed":
            reason = f"no started event from the actuator on {s['host']} yet"
        elif state is None:  # only records about it, no state (e.g. a progress event, a decision)
            state, reason = "unknown", "no submitted event seen for this job"
        spec = None
        targets = None
        if submitted is not None and submitted.spec is not None:
            sp = submitted.spec
            spec = {"model": sp.model, "dataset": sp.dataset, "batch_size": sp.batch_size,
                    "requests": asdict(sp.requests), "command": list(sp.command)}
            if sp.targets is not None:
                targets = self._targets(sp.targets, progress)
        return JobView(
            job=job, state=state, since=since, submitted=None if submitted is None else submitted.ts,
            workload=workload, priority=priority, host=s["host"], node=s["node"], container=s["container"],
            pid=s["pid"], cpuset=s["cpuset"], gpus=s["gpus"], spec=spec, reason=reason,
            exit_code=s["exit_code"], signal=s["signal"], oom=s["oom"], run_s=s["run_s"],
            prediction=None if prediction is None else _prediction_dict(prediction),
            observed=self._observed(prediction), progress=_progress_dict(progress, targets), targets=targets,
            decisions=tuple(decisions), timeline=tuple(timeline))

    def _why_waiting(self, now: float, submitted: JobEvent | None, prediction: UtilisationPrediction | None,
                     letters: list[DeadLetter], hint: str | None) -> str:
        why = []
        if letters:
            why.append(f"dead letter ({letters[-1].source_topic}): {letters[-1].reason}")
        if hint is not None:
            why.append(hint)
        elif submitted is not None and prediction is None and now - submitted.ts < self.config.prediction_wait_s:
            why.append(f"waits for Horus's prediction (placement waits {self.config.prediction_wait_s:g} s for "
                       "one, then places on the requests alone)")
        elif not letters:
            why.append("no place decision yet, and no word from the placement agent on why (is `phasewise place` "
                       "running, and are the job events' signatures its cluster key's?)")
        return "; ".join(why)

    def _observed(self, prediction: UtilisationPrediction | None) -> dict[str, Any] | None:
        """The mean of its steady samples (source ``samples``); without samples read, what Horus observed
        when it learned the job (source ``horus``, published again with its prediction), if it did."""
        j = self.j
        if not j.samples:
            learned = _learned(prediction)
            if not learned:
                return None
            return {"source": "horus", "samples": None, "first": None, "last": prediction.ts if prediction else None,
                    **{k: float(v) for k, v in learned.items() if k in TARGETS and isinstance(v, (int, float))}}
        out: dict[str, Any] = {"source": "samples", "samples": j.samples, "first": j.first_sample,
                               "last": j.last_sample}
        for name in TARGETS:
            if j.counts.get(name):
                out[name] = j.sums[name] / j.counts[name]
        return out

    @staticmethod
    def _targets(t: Any, progress: JobEvent | None) -> dict[str, Any]:
        value = _progress_value(progress, t.metric)
        reached = None
        if value is not None:
            for name in ("objective", "acceptable"):
                target = getattr(t, name)
                if target is not None and passed(value, target, t.direction):
                    reached = name
                    break
        return {"metric": t.metric, "direction": t.direction, "acceptable": t.acceptable,
                "objective": t.objective, "value": value, "reached": reached}


def _about_submission(dl: DeadLetter, submitted: JobEvent | None) -> bool:
    """Is *dl* about the job's submission (its ``submitted`` event refused or dropped: a reason it waits)?
    Not a dead letter of another of its records (a progress event, a second submission of its id)."""
    if dl.truncated:
        return True  # its payload cannot be told: it may be
    try:
        obj = json.loads(dl.payload)
    except (ValueError, RecursionError):
        return True
    if not isinstance(obj, dict) or "kind" not in obj:
        return True
    return submitted is not None and obj.get("kind") == "submitted" and obj.get("ts") == submitted.ts


def _entry(ts: float, source: str, r: Any, ignored: str | None) -> Entry:
    """The timeline entry of a record that changes nothing."""
    if isinstance(r, JobEvent):
        return Entry(ts, source, r.kind, _event_text(r), ignored)
    if isinstance(r, Decision):
        return Entry(ts, source, r.action, _decision_text(r), ignored)
    if isinstance(r, UtilisationPrediction):
        return Entry(ts, source, "prediction", _prediction_text(r), ignored)
    return Entry(ts, source, type(r).__name__, "", ignored)


def _progress_value(ev: JobEvent | None, metric: str) -> float | None:
    """The value of *metric* a progress event carries (the targets agent's reading)."""
    if ev is None:
        return None
    return ev.loss if metric == "loss" else (ev.metric if ev.metric_name in (None, metric) else None)


def _progress_dict(ev: JobEvent | None, targets: dict[str, Any] | None) -> dict[str, Any] | None:
    if ev is None:
        return None
    metric = targets["metric"] if targets else ("loss" if ev.loss is not None else ev.metric_name)
    value = _progress_value(ev, metric) if metric else None
    if value is None and ev.loss is not None:
        metric, value = "loss", ev.loss
    return {"ts": ev.ts, "step": ev.step, "epoch": ev.epoch, "metric": metric, "value": value}


def _learned(p: UtilisationPrediction | None) -> dict[str, Any]:
    """What Horus observed of the job when it learned it (a prediction published again with it), or {}."""
    return dict(getattr(p, "observed", None) or {}) if p is not None else {}


def _prediction_dict(p: UtilisationPrediction) -> dict[str, Any]:
    """The prediction's means and intervals; once Horus learned the job, what it observed and its log error
    per target (``observed``, ``log_error``)."""
    out: dict[str, Any] = {"ts": p.ts, "model_version": p.model_version, "first_sight": p.first_sight,
                           "device": p.device, "coverage": p.coverage}
    for name in TARGETS:
        iv = getattr(p, name)
        out[name] = {"mean": iv.mean, "lo": iv.lo, "hi": iv.hi}
    out["observed"] = _learned(p)
    out["log_error"] = dict(getattr(p, "log_error", None) or {})
    return out


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ts)) + "Z"


def cores(v: float | None) -> str:
    """CPU cores in words: ``1.5 cores``, ``1 core``."""
    return "-" if v is None else f"{v:.3g} core{'' if v == 1 else 's'}"


def size(v: float | None) -> str:
    """Bytes in binary units: ``512Mi``, ``1.5Gi``."""
    if v is None:
        return "-"
    for unit, scale in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}B"


def _event_text(ev: JobEvent) -> str:
    k = ev.kind
    if k == "submitted":
        if ev.spec is None:
            return f"{ev.workload}, priority {ev.priority} (no spec)"
        sp, r = ev.spec, ev.spec.requests
        asks = [f"cpu {cores(r.cpu_cores)}" if r.cpu_cores is not None else None,
                f"mem {size(r.mem_bytes)}" if r.mem_bytes is not None else None,
                f"gpus {r.gpus:g}" if r.gpus else None]
        asked = ", ".join(a for a in asks if a) or "nothing stated"
        return (f"{ev.workload}, priority {ev.priority}: {sp.model} on {sp.dataset}, batch {sp.batch_size}; "
                f"requests {asked}" + ("" if ev.signature else "; unsigned (never started by an actuator)"))
    if k == "started":
        where = [f"on {ev.host}", f"container {ev.container}" if ev.container else None,
                 f"pid {ev.pid}" if ev.pid else None, f"cpus {ev.cpuset}" if ev.cpuset else None,
                 f"gpus {','.join(ev.devices)}" if ev.devices else None]
        return " ".join(w for w in where if w)
    if k in ("finished", "failed", "terminated", "rejected", "lost"):
        how = [f"exit code {ev.exit_code}" if ev.exit_code is not None else None,
               f"signal {ev.signal}" if ev.signal else None, "OOM-killed" if ev.oom else None,
               f"after {age(ev.run_s)}" if ev.run_s is not None else None,
               f"on {ev.host}" if ev.host else None]
        text = ", ".join(h for h in how if h)
        return f"{text}{': ' if text and ev.reason else ''}{ev.reason or ''}" or k
    if k == "progress":
        parts = [f"step {ev.step}" if ev.step is not None else None,
                 f"epoch {ev.epoch:g}" if ev.epoch is not None else None,
                 f"loss {ev.loss:.4g}" if ev.loss is not None else None,
                 f"{ev.metric_name or 'metric'} {ev.metric:.4g}" if ev.metric is not None else None]
        return ", ".join(p for p in parts if p) or "progress"
    if k == "priority":
        return f"priority now {ev.priority}"
    if k == "scaled":
        return " ".join(p for p in (f"{ev.replicas} replica(s)" if ev.replicas is not None else None,
                                    f"(at most {ev.max_replicas})" if ev.max_replicas is not None else None,
                                    f"on {ev.host}" if ev.host else None, ev.reason) if p) or k
    if k in ("admitted", "stopped", "frozen", "thawed", "waiting"):
        return " ".join(p for p in (f"on {ev.host}" if ev.host else None, "(resume)" if ev.resume else None,
                                    ev.reason) if p) or k
    return k


def _decision_text(d: Decision) -> str:
    where = d.details.get("node")
    head = f"{d.policy} on {d.host}" + (f" (node {where})" if isinstance(where, str) and where != d.host else "")
    if d.details.get("cpuset"):
        head += f", cpus {d.details['cpuset']}"
    if d.cpu_limit_cores is not None or d.mem_limit_bytes is not None:
        head += f", limit cpu {cores(d.cpu_limit_cores)}, mem {size(d.mem_limit_bytes)}"
    return f"{head}: {d.reason}" if d.reason else head


def _prediction_text(p: UtilisationPrediction) -> str:
    text = (f"model v{p.model_version}{' (first of its model)' if p.first_sight else ''}: "
            f"cpu {p.cpu_cores.mean:.3g} [{p.cpu_cores.lo:.3g}, {p.cpu_cores.hi:.3g}] cores, "
            f"mem {size(p.mem_bytes.mean)} [{size(p.mem_bytes.lo)}, {size(p.mem_bytes.hi)}], "
            f"gpu {p.gpu_util.mean:.3g}% [{p.gpu_util.lo:.3g}, {p.gpu_util.hi:.3g}], "
            f"gpu mem {size(p.gpu_mem_bytes.mean)}")
    errors = dict(getattr(p, "log_error", None) or {})
    if errors:
        text += "; learned, log error " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(errors.items())
                                                   if isinstance(v, (int, float)))
    return text


def age(seconds: float | None) -> str:
    """A duration as ``kubectl`` shows ages: ``42s``, ``5m3s``, ``2h5m``, ``3d4h``.

    >>> age(42.4), age(303), age(7500), age(273600), age(None)
    ('42s', '5m3s', '2h5m', '3d4h', '-')
    """
    if seconds is None:
        return "-"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m" if (s % 3600) // 60 else f"{s // 3600}h"
    return f"{s // 86400}d{(s % 86400) // 3600}h" if (s % 86400) // 3600 else f"{s // 86400}d"
