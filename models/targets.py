"""TRADL loss targets: a two-tier target per training job, and the TRADL share rule. Pure: no IO.

A training job may carry targets ``<acceptable, objective>`` on its loss or on a
metric, with a direction (``min``: lower is better, e.g. a loss or a WER;
``max``: higher is better, e.g. an accuracy). :class:`TargetTracker` follows one
job's progress reports:

- it smooths the reported value (:class:`Smoother`: an EWMA with weight
  ``alpha`` on the newest value, or a median of the last ``window`` values);
- the smoothed value past *acceptable* for ``patience`` reports in a row is the
  ``acceptable`` event (the job can be delivered: its limits shrink);
- past *objective* for ``patience`` reports in a row is the ``objective`` event
  (graceful terminate: checkpoint and exit); ``grace_s`` seconds later, if the
  job has not finished, the ``hard_stop`` event.

Both smoothers give a convex combination (EWMA) or an order statistic
(median) of values the job reported, so a smoothed value past a target means
at least one reported value was past it: no target is declared before the
curve reached it.

:func:`tradl_share` is the TRADL allocation among the ``n`` jobs of one node:
while their summed use is at most ``alpha * capacity`` they compete freely (no
limits); above it a job using more than ``capacity / n`` gets
``capacity / (2n)`` and each other job ``capacity / (n + 1)``.

>>> t = TargetTracker(Targets(acceptable=1.0, objective=0.5), TargetsConfig(alpha=1.0, patience=1, grace_s=10))
>>> [e.kind for e in t.update(ts=1, step=1, value=2.0)]
[]
>>> [e.reason for e in t.update(ts=2, step=2, value=0.9)]
['loss 0.9 (smoothed ewma alpha=1) <= acceptable 1 at step 2']
>>> [e.kind for e in t.update(ts=3, step=3, value=0.4)], t.due(ts=12.9), t.due(ts=13.0).kind
(['objective'], None, 'hard_stop')
>>> tradl_share({"a": 1.5, "b": 0.3, "c": 0.1}, capacity=2.0, alpha=0.9)
{'a': 0.3333333333333333, 'b': 0.5, 'c': 0.5}
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phasewise.models.decisions import decision_id
from phasewise.schemas import Decision, JobControl

__all__ = [
    "ABSURD", "DIRECTIONS", "Smoother", "TargetEvent", "TargetTracker", "Targets", "TargetsConfig",
    "TARGETS_POLICY", "TargetsFleet", "acceptable_limits", "check_progress", "decide", "passed", "tradl_share",
]

DIRECTIONS = ("min", "max")
#: ``Decision.policy`` / ``JobControl.policy`` of what the targets produce
TARGETS_POLICY = "targets"
#: a reported loss or metric beyond this magnitude is a broken reporter, not a training curve
ABSURD = 1e9
STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Targets:
    """A job's two-tier target on one value (``metric``: ``loss`` or a metric's name)."""

    acceptable: float
    objective: float
    direction: str = "min"
    metric: str = "loss"

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be min or max, got {self.direction!r}")
        for name in ("acceptable", "objective"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if not passed(self.objective, self.acceptable, self.direction):
            word = "<=" if self.direction == "min" else ">="
            raise ValueError(f"objective must be {word} acceptable for direction {self.direction}, "
                             f"got acceptable {self.acceptable:g}, objective {self.objective:g}")


@dataclass(frozen=True, slots=True)
class TargetsConfig:
    """How values are smoothed and crossings confirmed.

    ``smoothing``: ``ewma`` (weight ``alpha`` on the newest value), ``median`` (of the last
    ``window`` values) or ``none``; ``patience``: reports in a row past a target before it is
    declared; ``grace_s``: seconds between the graceful terminate and the hard stop.
    """

    smoothing: str = "ewma"
    alpha: float = 0.3
    window: int = 5
    patience: int = 3
    grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.smoothing not in ("ewma", "median", "none"):
            raise ValueError(f"smoothing must be ewma, median or none, got {self.smoothing!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if self.window < 1 or self.patience < 1:
            raise ValueError("window and patience must be at least 1")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")

    def describe(self) -> str:
        if self.smoothing == "ewma":
            return f"ewma alpha={self.alpha:g}"
        if self.smoothing == "median":
            return f"median window={self.window}"
        return "unsmoothed"


def passed(value: float, target: float, direction: str) -> bool:
    """Is *value* at or past *target* in *direction*?

    >>> passed(0.3, 0.5, "min"), passed(0.3, 0.5, "max"), passed(0.5, 0.5, "max")
    (True, False, True)
    """
    return value <= target if direction == "min" else value >= target


class Smoother:
    """EWMA, windowed median or nothing, over one job's reported values."""

    def __init__(self, config: TargetsConfig) -> None:
        self.config = config
        self._ewma: float | None = None
        self._window: deque[float] = deque(maxlen=config.window)

    def learn_one(self, value: float) -> float:
        c = self.config
        if c.smoothing == "ewma":
            self._ewma = value if self._ewma is None else c.alpha * value + (1 - c.alpha) * self._ewma
            return self._ewma
        self._window.append(value)
        if c.smoothing == "median":
            return float(statistics.median(self._window))
        return value

    def to_state(self) -> dict[str, Any]:
        return {"ewma": self._ewma, "window": list(self._window)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self._ewma = state.get("ewma")
        self._window.clear()
        self._window.extend(state.get("window", ()))


@dataclass(frozen=True, slots=True)
class TargetEvent:
    """A target reached: ``acceptable`` (shrink), ``objective`` (graceful terminate) or ``hard_stop``."""

    kind: str
    ts: float
    step: int
    value: float  #: the smoothed value that crossed (for hard_stop: the one that crossed objective)
    raw: float  #: the last reported value
    target: float
    metric: str
    direction: str
    reason: str

    def details(self) -> dict[str, Any]:
        return {"event": self.kind, "metric": self.metric, "direction": self.direction, "smoothed": self.value,
                "raw": self.raw, "target": self.target, "step": self.step}


class TargetTracker:
    """One job's progress against its targets: ``running`` → ``acceptable`` → ``objective`` → ``stopped``."""

    def __init__(self, targets: Targets, config: TargetsConfig | None = None) -> None:
        self.targets = targets
        self.config = config or TargetsConfig()
        self.smoother = Smoother(self.config)
        self.state = "running"
        self.smoothed: float | None = None
        self.last_step: int | None = None
        self._streak = {"acceptable": 0, "objective": 0}
        self._objective_event: TargetEvent | None = None

    def update(self, *, ts: float, step: int, value: float) -> list[TargetEvent]:
        """Learn one report; the events it causes (both tiers at once when it passes both)."""
        t, c = self.targets, self.config
        self.last_step = step
        s = self.smoother.learn_one(value)
        self.smoothed = s
        events: list[TargetEvent] = []
        if self.state in ("objective", "stopped"):
            return events
        for kind, target in (("acceptable", t.acceptable), ("objective", t.objective)):
            self._streak[kind] = self._streak[kind] + 1 if passed(s, target, t.direction) else 0
        word = "<=" if t.direction == "min" else ">="
        for kind, target in (("acceptable", t.acceptable), ("objective", t.objective)):
            if kind == "acceptable" and self.state != "running":
                continue
            if self._streak[kind] >= c.patience:
                confirm = f", {c.patience} reports in a row" if c.patience > 1 else ""
                ev = TargetEvent(kind, ts, step, s, value, target, t.metric, t.direction,
                                 f"{t.metric} {s:.4g} (smoothed {c.describe()}) {word} {kind} {target:.4g} "
                                 f"at step {step}{confirm}")
                events.append(ev)
                self.state = kind
        for ev in events:
            if ev.kind == "objective":
                self._objective_event = ev
        return events

    def due(self, ts: float) -> TargetEvent | None:
        """The hard stop, once ``grace_s`` has passed since the objective without the job finishing."""
        ev = self._objective_event
        if self.state != "objective" or ev is None or ts < ev.ts + self.config.grace_s:
            return None
        self.state = "stopped"
        return TargetEvent("hard_stop", ts, ev.step, ev.value, ev.raw, ev.target, ev.metric, ev.direction,
                           f"no exit {self.config.grace_s:g} s after {ev.reason}: hard stop")

    def finished(self) -> None:
        """The job ended on its own (e.g. it honoured checkpoint_exit): no hard stop is due."""
        self.state = "stopped"

    def to_state(self) -> dict[str, Any]:
        ev = self._objective_event
        return {"version": STATE_VERSION, "state": self.state, "smoothed": self.smoothed, "last_step": self.last_step,
                "streak": dict(self._streak), "smoother": self.smoother.to_state(),
                "objective_event": None if ev is None else {f: getattr(ev, f) for f in ev.__slots__}}

    @classmethod
    def from_state(cls, targets: Targets, config: TargetsConfig, state: Mapping[str, Any]) -> TargetTracker:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TargetTracker state version {state.get('version')!r}, expected {STATE_VERSION}")
        t = cls(targets, config)
        t.state = state["state"]
        t.smoothed = state["smoothed"]
        t.last_step = state["last_step"]
        t._streak = dict(state["streak"])
        t.smoother.load_state(state["smoother"])
        ev = state.get("objective_event")
        t._objective_event = None if ev is None else TargetEvent(**ev)
        return t


def check_progress(value: Any, step: Any, last_step: int | None) -> str | None:
    """Why a progress report cannot be used (None: it can).

    >>> check_progress(float("nan"), 3, 2), check_progress(1.0, 2, 5), check_progress(1e12, 3, 2)
    ('value nan is not finite', 'step 2 goes backwards (last 5)', 'value 1e+12 is absurd (|value| > 1e+09)')
    >>> check_progress(0.5, 6, 5) is None
    True
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is not a non-negative integer"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"value {value!r} is not a number"
    if not math.isfinite(value):
        return f"value {value!r} is not finite"
    if abs(value) > ABSURD:
        return f"value {value:g} is absurd (|value| > {ABSURD:g})"
    if last_step is not None and step < last_step:
        return f"step {step} goes backwards (last {last_step})"
    return None


def tradl_share(usage: Mapping[str, float], capacity: float, alpha: float) -> dict[str, float] | None:
    """TRADL's limits for the jobs of one node, or None while they may compete freely.

    *usage*: each job's current use (cores); *capacity*: the node's (cores); *alpha*: the
    fraction of capacity above which the rule applies. Above it, a job using more than
    ``capacity / n`` gets ``capacity / (2n)``, every other job ``capacity / (n + 1)``.

    >>> tradl_share({"a": 0.5, "b": 0.5}, capacity=4, alpha=0.8) is None
    True
    >>> tradl_share({"a": 3.0, "b": 0.5}, capacity=4, alpha=0.8)
    {'a': 1.0, 'b': 1.3333333333333333}
    """
    if not capacity > 0 or not math.isfinite(capacity):
        raise ValueError(f"capacity must be a positive number, got {capacity!r}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    n = len(usage)
    if n == 0 or sum(usage.values()) <= alpha * capacity:
        return None
    fair = capacity / n
    return {job: capacity / (2 * n) if use > fair else capacity / (n + 1) for job, use in usage.items()}


def decide(event: TargetEvent, *, host: str, container: str, shrink_to_cores: float | None,
           grace_s: float) -> tuple[Decision | None, JobControl | None]:
    """What a target event asks for: ``acceptable`` → a lower CPU limit (*shrink_to_cores*);
    ``objective`` → ``checkpoint_exit`` to the job with *grace_s*; ``hard_stop`` → a terminate decision.

    >>> ev = TargetEvent("acceptable", 5.0, 40, 0.9, 0.8, 1.0, "loss", "min", "loss 0.9 <= acceptable 1")
    >>> d, c = decide(ev, host="h", container="job-a", shrink_to_cores=0.1, grace_s=30)
    >>> d.action, d.cpu_limit_cores, d.reason, c
    ('limit', 0.1, 'loss 0.9 <= acceptable 1: shrink to 0.1 cores', None)
    """
    details = event.details()
    if event.kind == "acceptable":
        if shrink_to_cores is None:
            return None, None
        return Decision(id=decision_id(TARGETS_POLICY, host, container, shrink_to_cores, None, event.ts),
                        ts=event.ts, host=host, container=container, action="limit", policy=TARGETS_POLICY,
                        reason=f"{event.reason}: shrink to {shrink_to_cores:g} cores",
                        cpu_limit_cores=shrink_to_cores, details=details), None
    if event.kind == "objective":
        cid = decision_id(TARGETS_POLICY, host, container, None, None, event.ts)
        return None, JobControl(id=cid, job=container, ts=event.ts, action="checkpoint_exit",
                                policy=TARGETS_POLICY, reason=event.reason, grace_s=grace_s)
    return Decision(id=decision_id(TARGETS_POLICY + "-stop", host, container, None, None, event.ts), ts=event.ts,
                    host=host, container=container, action="terminate", policy=TARGETS_POLICY, reason=event.reason,
                    details={**details, "hard": True}), None


def acceptable_limits(past: Mapping[str, bool], capacity: float, shrink: float) -> dict[str, float | None]:
    """CPU limits of a node's jobs from who is past acceptable (True) and who is not.

    A job past acceptable is held to ``shrink * capacity / n`` while some job of the node
    is still short of it (the freed CPU goes to that job); once none is, nobody is
    held (None: no limit), so the node's CPU is never left idle for the rule's sake.

    >>> acceptable_limits({"a": True, "b": False}, capacity=2.0, shrink=0.25)
    {'a': 0.25, 'b': None}
    >>> acceptable_limits({"a": True, "b": True}, capacity=2.0, shrink=0.25)
    {'a': None, 'b': None}
    """
    if not 0 < shrink <= 1:
        raise ValueError(f"shrink must be in (0, 1], got {shrink!r}")
    n = len(past)
    short = any(not p for p in past.values())
    return {job: shrink * capacity / n if p and short else None for job, p in past.items()}


class TargetsFleet:
    """The targets of every job a worker follows, fed :class:`~phasewise.schemas.JobEvent` records.

    ``submitted`` with ``spec.targets`` starts following a job; ``started`` says where it runs
    (host, container); ``progress`` is checked (:func:`check_progress`) and learned;
    ``finished`` stops following it. :meth:`process` returns the decisions and controls an
    event causes, or the reason it cannot be used (an unknown job, a NaN loss, steps going
    backwards, an absurd value): the caller dead-letters it and the job is unaffected.

    >>> from phasewise.schemas import JobEvent, JobSpec, JobTargets
    >>> f = TargetsFleet(TargetsConfig(smoothing="none", patience=1), capacity=lambda host: 4.0, shrink=0.25)
    >>> spec = JobSpec(model="m", dataset="d", batch_size=8, targets=JobTargets(acceptable=1.0, objective=0.5))
    >>> f.process(JobEvent(job="a", ts=1, kind="submitted", spec=spec))
    ([], [], None)
    >>> f.process(JobEvent(job="b", ts=1, kind="progress", step=1, loss=0.3))[2]
    "unknown job 'b' (no submitted event with targets)"
    >>> d, c, why = f.process(JobEvent(job="a", ts=2, kind="progress", step=1, loss=0.9))
    >>> [x.action for x in d], d[0].cpu_limit_cores, c, why
    (['limit'], 1.0, [], None)
    """

    def __init__(self, config: TargetsConfig, *, capacity: Any, shrink: float = 0.25,
                 default_host: str = "unknown") -> None:
        self.config = config
        self.capacity = capacity  #: host -> its CPU cores (a callable)
        self.shrink = shrink
        self.default_host = default_host
        self.jobs: dict[str, TargetTracker] = {}
        self.where: dict[str, tuple[str, str]] = {}  #: job -> (host, container)

    def __len__(self) -> int:
        return len(self.jobs)

    def process(self, ev: Any) -> tuple[list[Decision], list[JobControl], str | None]:
        if ev.kind == "submitted":
            t = getattr(getattr(ev, "spec", None), "targets", None)
            if t is None or t.acceptable is None or t.objective is None:
                return [], [], None  # no two-tier target: nothing to follow
            try:
                targets = Targets(acceptable=t.acceptable, objective=t.objective, direction=t.direction,
                                  metric=t.metric)
            except ValueError as e:
                return [], [], f"job {ev.job!r}: targets: {e}"
            self.jobs[ev.job] = TargetTracker(targets, self.config)
            return [], [], None
        if ev.kind == "started":
            if ev.host:
                self.where[ev.job] = (ev.host, ev.container or ev.job)
            return [], [], None
        if ev.kind == "finished":
            tracker = self.jobs.pop(ev.job, None)
            self.where.pop(ev.job, None)
            if tracker is not None:
                tracker.finished()
            return [], [], None
        tracker = self.jobs.get(ev.job)
        if tracker is None:
            return [], [], f"unknown job {ev.job!r} (no submitted event with targets)"
        metric = tracker.targets.metric
        value = ev.loss if metric == "loss" else (ev.metric if ev.metric_name in (None, metric) else None)
        if value is None:
            return [], [], f"job {ev.job!r}: progress carries no {metric}"
        why = check_progress(value, ev.step, tracker.last_step)
        if why is not None:
            return [], [], f"job {ev.job!r}: {why}"
        if ev.host and ev.job not in self.where:
            self.where[ev.job] = (ev.host, ev.container or ev.job)
        host, container = self.where.get(ev.job, (self.default_host, ev.job))
        decisions: list[Decision] = []
        controls: list[JobControl] = []
        for te in tracker.update(ts=ev.ts, step=ev.step, value=float(value)):
            shrink_to = None
            if te.kind == "acceptable":
                n = sum(1 for h, _ in self.where.values() if h == host) or 1
                shrink_to = round(self.shrink * float(self.capacity(host)) / n, 3)
            d, c = decide(te, host=host, container=container, shrink_to_cores=shrink_to,
                          grace_s=self.config.grace_s)
            decisions += [d] if d is not None else []
            controls += [c] if c is not None else []
        return decisions, controls, None

    def due(self, ts: float) -> list[Decision]:
        """Hard stops whose grace period has passed by event time *ts*."""
        out = []
        for job, tracker in self.jobs.items():
            te = tracker.due(ts)
            if te is not None:
                host, container = self.where.get(job, (self.default_host, job))
                d, _ = decide(te, host=host, container=container, shrink_to_cores=None, grace_s=self.config.grace_s)
                if d is not None:
                    out.append(d)
        return out
