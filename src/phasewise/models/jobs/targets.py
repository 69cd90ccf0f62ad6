"""TRADL loss targets, pure: a two-tier target per training job, the node policies and the TRADL share
rule.

:class:`TargetTracker` follows one job's progress reports: the smoothed value (:class:`Smoother`: EWMA
or median, so no target is declared before the curve reached it) past *acceptable*, then *objective*,
for ``patience`` reports in a row, then a hard stop ``grace_s`` after the objective;
:class:`TargetsFleet` follows every job of a worker and divides each node among its jobs
(:func:`node_limits`, :func:`tradl_share`). Narrative: docs/targets.md ("In the worker", "Smoothing",
"The TRADL share rule").

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

from phasewise.kit.records import Decision, JobControl
from phasewise.models.decisions import decision_id
from phasewise.models.jobs.lifecycle import STOP_EXITS

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


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetsConfig:
    """How values are smoothed and crossings confirmed.

    ``smoothing``: ``ewma`` (weight ``alpha`` on the newest value), ``median`` (of the last
    ``window`` values) or ``none``; ``patience``: reports in a row past a target before it is
    declared; ``grace_s``: seconds between the graceful terminate and the hard stop. The agent
    builds them from its ``targets_*`` settings, which hold the defaults of ``alpha``, ``patience``
    and ``grace_s`` (docs/architecture.md, "Defaults").
    """

    smoothing: str = "ewma"
    alpha: float
    window: int = 5
    patience: int
    grace_s: float

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

    def __init__(self, targets: Targets, config: TargetsConfig) -> None:
        self.targets = targets
        self.config = config
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
        # stamped with when it fell due (not when it was noticed): the same stop decided again after a
        # restart is the same decision, which an actuator applies once
        return TargetEvent("hard_stop", ev.ts + self.config.grace_s, ev.step, ev.value, ev.raw, ev.target,
                           ev.metric, ev.direction, f"no exit {self.config.grace_s:g} s after {ev.reason}: hard stop")

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


def remaining_work(cpu_s: float | None, first: float | None, smoothed: float | None, objective: float) -> float | None:
    """Estimated CPU-seconds a job still needs to its objective (None: no estimate yet).

    *cpu_s*: the CPU-seconds it used so far; *first*: its first smoothed value;
    *smoothed*: its smoothed value now. ``g``, the fraction of the way from *first*
    to *objective* it has come, is progress per CPU-second spent; at that rate the
    rest takes ``cpu_s * (1 - g) / g``. Training curves flatten, so this
    underestimates every job's remaining work; what the node policy uses is the
    order of the estimates. A job that has not moved yet (its first report) has no
    estimate; one that moved away from its objective gets ``inf``; one past it, 0.

    >>> remaining_work(2.0, first=5.0, smoothed=3.0, objective=1.0)  # half way in 2 CPU-s
    2.0
    >>> remaining_work(2.0, first=5.0, smoothed=5.5, objective=1.0), remaining_work(2.0, 5.0, 5.0, 1.0)
    (inf, None)
    """
    if cpu_s is None or first is None or smoothed is None or not math.isfinite(cpu_s) or cpu_s <= 0:
        return None  # no CPU measured yet: no rate of progress either
    span = first - objective
    if span == 0:
        return 0.0
    g = (first - smoothed) / span  # the same for direction max: both differences change sign
    if g >= 1:
        return 0.0
    if g == 0:
        return None
    if g < 0:
        return math.inf
    return max(0.0, cpu_s) * (1 - g) / g


#: how the node's CPU is divided among the jobs still short of their objective
NODE_POLICIES = ("tradl", "nearest")
#: ``nearest`` moves the node to another job only when that job's estimate is below this fraction of the
#: favoured job's (estimates are noisy: without it the node would change hands at every report)
SWITCH_BELOW = 0.9


@dataclass(frozen=True, slots=True)
class NodeJob:
    """What the node policy knows of one job still short of its objective."""

    past_acceptable: bool = False
    use: float | None = None  #: cores it uses now (its container's latest sample)
    remaining: float | None = None  #: :func:`remaining_work`
    crossed: str = ""  #: the reason of its acceptable event (which value crossed which target)


@dataclass(frozen=True, slots=True)
class NodePlan:
    """Each job's CPU limit (None: none) and why; ``favoured``: the job ``nearest`` gives the node to."""

    limits: dict[str, float | None]
    reasons: dict[str, str]
    favoured: str | None = None


def node_limits(jobs: Mapping[str, NodeJob], capacity: float, *, policy: str = "tradl", shrink: float = 0.25,
                alpha: float | None = None, favoured: str | None = None, host: str = "node") -> NodePlan:
    """CPU limits of the jobs of one node that are still short of their objective.

    ``tradl`` (the paper's rule, :func:`acceptable_limits`): a job past acceptable is
    held to ``shrink x capacity / n`` while some job of the node is short of acceptable
    (the CPU it frees goes to those), and released when none is.

    ``nearest``: the job with the least :func:`remaining_work` to its objective gets
    the node, every other job is held to ``shrink x capacity / n`` (shortest remaining
    work first, which minimises the mean time to objective when the estimates are
    right; :data:`SWITCH_BELOW` keeps the *favoured* job until another is clearly
    nearer). Nobody is held while some job has no estimate yet, none is moving
    towards its objective, or with one job.

    With *alpha*, the TRADL share rule (:func:`tradl_share`) over the jobs' use caps
    the limits too (the lower limit wins) once every job's use is known. A job with no
    limit from any rule gets None: whatever limit the policy had set is released.

    >>> p = node_limits({"a": NodeJob(True, crossed="loss 0.9 <= acceptable 1"), "b": NodeJob()}, 2.0, host="h1")
    >>> p.limits
    {'a': 0.25, 'b': None}
    >>> p.reasons["a"]
    'loss 0.9 <= acceptable 1: held to 0.25 x 2 / 2 = 0.25 cores while b is short of acceptable (TRADL acceptable rule)'
    >>> q = node_limits({"a": NodeJob(remaining=3.0), "b": NodeJob(remaining=1.0)}, 2.0, policy="nearest")
    >>> q.limits, q.favoured
    ({'a': 0.25, 'b': None}, 'b')
    """
    if policy not in NODE_POLICIES:
        raise ValueError(f"node policy must be one of {', '.join(NODE_POLICIES)}, got {policy!r}")
    n = len(jobs)
    limits: dict[str, float | None] = dict.fromkeys(jobs)
    why: dict[str, list[str]] = {j: [] for j in jobs}
    held = round(shrink * capacity / n, 3) if n else 0.0
    held_text = f"{shrink:g} x {capacity:g} / {n} = {held:g} cores"
    chosen = None
    if policy == "tradl":
        short = sorted(j for j, v in jobs.items() if not v.past_acceptable)
        for j, lim in acceptable_limits({j: v.past_acceptable for j, v in jobs.items()}, capacity, shrink).items():
            if lim is not None:
                limits[j] = round(lim, 3)
                who = ", ".join(short[:5]) + (", ..." if len(short) > 5 else "")
                verb = "is" if len(short) == 1 else "are"
                why[j].append(f"{jobs[j].crossed or j + ' is past acceptable'}: held to {held_text} while {who} "
                              f"{verb} short of acceptable (TRADL acceptable rule)")
    elif n > 1 and all(v.remaining is not None for v in jobs.values()):
        rem = {j: float(v.remaining) for j, v in jobs.items()}  # type: ignore[arg-type]
        chosen = min(sorted(rem), key=lambda j: rem[j])
        if favoured in rem and favoured != chosen and not rem[chosen] < SWITCH_BELOW * rem[favoured]:
            chosen = favoured
        if math.isinf(rem[chosen]):  # none of them is moving towards its objective: nobody to prefer
            chosen = None
        for j in jobs if chosen is not None else ():
            if j != chosen:
                limits[j] = held
                why[j].append(f"nearest first: {chosen} is estimated {rem[chosen]:.3g} CPU-s from its objective, "
                              f"{j} {rem[j]:.3g}: held to {held_text}")
    if alpha is not None and jobs and all(v.use is not None for v in jobs.values()):
        usage = {j: float(v.use) for j, v in jobs.items()}  # type: ignore[arg-type]
        share = tradl_share(usage, capacity, alpha)
        if share is not None:
            total = sum(usage.values())
            node = (f"TRADL share rule: node {host}'s {n} jobs use {total:.3g} cores > alpha {alpha:g} x {capacity:g} "
                    f"= {alpha * capacity:.3g}")
            shares = ", ".join(f"{j} {usage[j]:.3g} -> {share[j]:.3g}" for j in sorted(share))
            for j, lim in share.items():
                more = usage[j] > capacity / n
                mine = (f"{j} uses {usage[j]:.3g} {'>' if more else '<='} 1/n = {capacity / n:.3g}: "
                        f"{'1/(2n)' if more else '1/(n+1)'} = {lim:.3g} cores")
                why[j].append(f"{node}; {mine} (shares: {shares})")
                limits[j] = round(lim, 3) if limits[j] is None else min(limits[j], round(lim, 3))  # type: ignore[type-var]
    reasons = {}
    for j in jobs:
        if why[j]:
            reasons[j] = "; ".join(why[j])
        elif policy == "nearest" and j == chosen:
            reasons[j] = (f"nearest first: {j} is estimated {jobs[j].remaining:.3g} CPU-s from its objective, "
                          f"the least of node {host}'s {n} jobs: no limit")
        else:
            reasons[j] = f"no rule holds {j} on node {host} now ({n} job(s) short of their objective): no limit"
    return NodePlan(limits, reasons, chosen)


@dataclass
class _Job:
    """One followed job: its tracker, where it runs, what it uses, the limit this fleet set last."""

    tracker: TargetTracker
    host: str | None = None
    container: str | None = None
    use: float | None = None  #: cores, the container's latest sample
    cpu_s: float = 0.0  #: CPU-seconds its container used, summed from the samples
    sample_ts: float | None = None  #: event time of the newest sample summed
    first: float | None = None  #: its first smoothed value
    cpu_at_report: float | None = None  #: cpu_s at its latest progress report
    limit: float | None = None  #: the CPU limit this fleet set last (None: none)
    crossed: str = ""  #: the reason of its acceptable event
    #: the priority agent stopped it to resume it (its ``stopped`` event), until it starts again: an end seen
    #: meanwhile is that stop's exit, not the job's end
    stopping: bool = False

    def to_state(self) -> dict[str, Any]:
        t = self.tracker.targets
        return {"v": FLEET_STATE_VERSION, "targets": [t.acceptable, t.objective, t.direction, t.metric],
                "tracker": self.tracker.to_state(), "host": self.host, "container": self.container, "use": self.use,
                "cpu_s": self.cpu_s, "sample_ts": self.sample_ts, "first": self.first,
                "cpu_at_report": self.cpu_at_report, "limit": self.limit, "crossed": self.crossed,
                "stopping": self.stopping}


FLEET_STATE_VERSION = 1
#: jobs submitted without targets the fleet remembers, to skip their progress (:attr:`TargetsFleet.untargeted`)
MAX_UNTARGETED = 10_000


class TargetsFleet:
    """The targets of every job a worker follows, fed :class:`~phasewise.kit.records.JobEvent` records and samples.

    ``submitted`` with ``spec.targets`` starts following a job; ``started`` says where it runs
    (host, container); ``progress`` is checked (:func:`check_progress`) and learned;
    ``finished``, ``failed``, ``rejected``, ``lost`` stop following it, so does ``terminated`` once
    the objective was reached (another's stop, a preemption, takes it off its node until it starts
    again; so does a ``finished`` or ``failed`` after the priority agent's ``stopped``: the exit of its
    checkpoint stop, come before the actuator's ``terminated``). :meth:`process` returns the decisions and controls an
    event causes, or the reason it cannot be used (an unknown job, a NaN loss, steps going
    backwards, an absurd value): the caller dead-letters it and the job is unaffected.
    :meth:`samples` takes a host's samples: the use of the jobs' containers (for the share
    rule and the remaining-work estimates) and the host's CPU count (the node's capacity;
    *capacity* where the samples do not say). Whenever a node's jobs change (one passes
    acceptable or objective, starts, finishes; every report with ``nearest``; every
    *share_interval_s* of samples with the share rule), :func:`node_limits` divides the node
    again and a ``limit`` decision goes out for every job whose limit changed (a release is the
    node's cores). :meth:`pop_dirty` / :meth:`load` carry each job's state to a table and back.

    >>> from phasewise.kit.records import JobEvent, JobSpec, JobTargets
    >>> cfg = TargetsConfig(smoothing="none", alpha=0.3, patience=1, grace_s=30)
    >>> f = TargetsFleet(cfg, capacity=lambda host: 4.0, shrink=0.25)
    >>> spec = JobSpec(model="m", dataset="d", batch_size=8, targets=JobTargets(acceptable=1.0, objective=0.5))
    >>> for job in ("a", "b"):
    ...     _ = f.process(JobEvent(job=job, ts=1, kind="submitted", spec=spec))
    ...     _ = f.process(JobEvent(job=job, ts=1, kind="started", host="h1", container=job))
    >>> f.process(JobEvent(job="c", ts=1, kind="progress", step=1, loss=0.3))[2]
    "unknown job 'c' (no submitted event with targets)"
    >>> _ = f.process(JobEvent(job="n", ts=1, kind="submitted", spec=JobSpec(model="m", dataset="d", batch_size=8)))
    >>> f.process(JobEvent(job="n", ts=2, kind="progress", step=1, loss=0.3))  # no targets: not this agent's
    ([], [], None)
    >>> d, c, why = f.process(JobEvent(job="a", ts=2, kind="progress", step=1, loss=0.9))
    >>> [(x.action, x.container, x.cpu_limit_cores) for x in d], c, why
    ([('limit', 'a', 0.5)], [], None)
    >>> d, c, why = f.process(JobEvent(job="b", ts=3, kind="progress", step=1, loss=0.9))  # none short: released
    >>> [(x.container, x.cpu_limit_cores) for x in d]
    [('a', 4.0)]
    """

    def __init__(self, config: TargetsConfig, *, capacity: Any, shrink: float = 0.25, default_host: str = "unknown",
                 policy: str = "tradl", share_alpha: float | None = None, share_interval_s: float = 30.0) -> None:
        if policy not in NODE_POLICIES:
            raise ValueError(f"node policy must be one of {', '.join(NODE_POLICIES)}, got {policy!r}")
        self.config = config
        self.capacity = capacity  #: host -> its CPU cores where its samples do not say (a callable)
        self.shrink = shrink
        self.default_host = default_host
        self.policy = policy
        self.share_alpha = share_alpha
        self.share_interval_s = share_interval_s
        self.jobs: dict[str, _Job] = {}
        self.host_cores: dict[str, float] = {}  #: host -> CPU count from its samples
        self._favoured: dict[str, str] = {}
        self._share_at: dict[str, float] = {}
        self._dirty: set[str] = set()
        #: jobs submitted without a two-tier target (the newest :data:`MAX_UNTARGETED`): their progress is
        #: another agent's concern, skipped, not a dead letter as a job never submitted is
        self.untargeted: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def where(self) -> dict[str, tuple[str, str]]:
        """job -> (host, container) of the jobs whose host is known."""
        return {j: (x.host, x.container or j) for j, x in self.jobs.items() if x.host is not None}

    def node_capacity(self, host: str) -> float:
        return float(self.host_cores.get(host) or self.capacity(host))

    def hosts(self) -> set[str]:
        """The hosts where followed jobs run."""
        return {x.host for x in self.jobs.values() if x.host is not None}

    # ------------------------------------------------------------------ events

    def process(self, ev: Any) -> tuple[list[Decision], list[JobControl], str | None]:
        if ev.kind == "submitted":
            t = getattr(getattr(ev, "spec", None), "targets", None)
            if t is None or t.acceptable is None or t.objective is None:
                self.untargeted[ev.job] = None  # no two-tier target: nothing to follow
                while len(self.untargeted) > MAX_UNTARGETED:
                    del self.untargeted[next(iter(self.untargeted))]
                return [], [], None
            try:
                targets = Targets(acceptable=t.acceptable, objective=t.objective, direction=t.direction,
                                  metric=t.metric)
            except ValueError as e:
                return [], [], f"job {ev.job!r}: targets: {e}"
            old = self.jobs.get(ev.job)
            self.jobs[ev.job] = _Job(TargetTracker(targets, self.config), host=old.host if old else ev.host,
                                     container=old.container if old else ev.container)
            self._dirty.add(ev.job)
            return [], [], None
        if ev.kind == "stopped":  # the priority agent's checkpoint stop: its exit is not the job's end
            job = self.jobs.get(ev.job)
            if job is not None and job.tracker.state not in ("objective", "stopped") and not job.stopping:
                job.stopping = True
                self._dirty.add(ev.job)
            return [], [], None
        if ev.kind == "started":
            job = self.jobs.get(ev.job)
            if job is None or not ev.host:
                return [], [], None
            before = job.host
            job.host, job.container, job.stopping = ev.host, ev.container or ev.job, False
            self._dirty.add(ev.job)
            out = self._divide(ev.host, ev.ts)
            if before is not None and before != ev.host:
                out += self._divide(before, ev.ts)
            return out, [], None
        followed = self.jobs.get(ev.job)
        stop_exit = ev.kind in STOP_EXITS and followed is not None and followed.stopping
        if not stop_exit and (ev.kind in ("finished", "failed", "rejected", "lost") or (
                ev.kind == "terminated" and followed is not None
                and followed.tracker.state in ("objective", "stopped"))):
            # it ended (terminated: after the objective, the stop these targets asked for): no longer followed
            job = self.jobs.pop(ev.job, None)
            if job is None:
                return [], [], None
            job.tracker.finished()
            self._dirty.add(ev.job)
            return (self._divide(job.host, ev.ts) if job.host is not None else []), [], None
        if ev.kind == "terminated" or stop_exit:
            # stopped by another (a preemption; or the exit of the priority agent's checkpoint stop, seen before
            # the actuator handled its terminate): off its node until a started event puts it back (resumed)
            job = self.jobs.get(ev.job)
            if job is None or job.host is None:
                return [], [], None
            host, job.host, job.limit = job.host, None, None
            self._dirty.add(ev.job)
            return self._divide(host, ev.ts), [], None
        if ev.kind != "progress":  # e.g. a new priority: the priority agent's concern
            return [], [], None
        job = self.jobs.get(ev.job)
        if job is None:
            if ev.job in self.untargeted:
                return [], [], None
            return [], [], f"unknown job {ev.job!r} (no submitted event with targets)"
        tracker = job.tracker
        metric = tracker.targets.metric
        value = ev.loss if metric == "loss" else (ev.metric if ev.metric_name in (None, metric) else None)
        if value is None:
            if ev.stage is not None:  # a stage report (``progress --stages``: load, eval, checkpoint ...)
                return [], [], None
            return [], [], f"job {ev.job!r}: progress carries no {metric}"
        why = check_progress(value, ev.step, tracker.last_step)
        if why is not None:
            return [], [], f"job {ev.job!r}: {why}"
        if ev.host and job.host is None:
            job.host, job.container = ev.host, ev.container or ev.job
        host = job.host or self.default_host
        container = job.container or ev.job
        decisions: list[Decision] = []
        controls: list[JobControl] = []
        events = tracker.update(ts=ev.ts, step=ev.step, value=float(value))
        if job.first is None:
            job.first = tracker.smoothed
        job.cpu_at_report = job.cpu_s if job.sample_ts is not None else None  # no samples yet: no estimate
        self._dirty.add(ev.job)
        for te in events:
            if te.kind == "acceptable":
                job.crossed = te.reason
            elif te.kind == "objective":
                _, c = decide(te, host=host, container=container, shrink_to_cores=None, grace_s=self.config.grace_s)
                controls += [c] if c is not None else []
        if (events or self.policy == "nearest") and job.host is not None:  # a job nowhere known is held nowhere
            decisions += self._divide(job.host, ev.ts)
        return decisions, controls, None

    def samples(self, hs: Any) -> list[Decision]:
        """Learn a host's samples (its CPU count, its jobs' use); the limit decisions a new division causes."""
        host = hs.host
        if getattr(hs, "host_cpu_count", None):
            self.host_cores[host] = float(hs.host_cpu_count)
        mine = {x.container or j: j for j, x in self.jobs.items() if x.host == host}
        if not mine:
            return []
        for cs in hs.containers:
            j = mine.get(cs.container)
            if j is None:
                continue
            job = self.jobs[j]
            if job.sample_ts is not None and hs.ts <= job.sample_ts:
                continue  # seen before (a re-read after a restart) or out of order
            job.use = float(cs.cpu_cores)
            job.cpu_s += float(cs.cpu_cores) * float(hs.interval_s)
            job.sample_ts = hs.ts
            self._dirty.add(j)
        if self.share_alpha is None or hs.ts < self._share_at.get(host, -math.inf) + self.share_interval_s:
            return []
        return self._divide(host, hs.ts)

    def due(self, ts: float) -> list[Decision]:
        """Hard stops whose grace period has passed by event time *ts*."""
        out = []
        for j, job in self.jobs.items():
            te = job.tracker.due(ts)
            if te is not None:
                self._dirty.add(j)
                d, _ = decide(te, host=job.host or self.default_host, container=job.container or j,
                              shrink_to_cores=None, grace_s=self.config.grace_s)
                if d is not None:
                    out.append(d)
        return out

    # ------------------------------------------------------------------ the node

    def _divide(self, host: str, ts: float) -> list[Decision]:
        """Divide *host* among its jobs short of their objective again; decisions for the limits that changed."""
        here = {j: x for j, x in self.jobs.items() if x.host == host and x.tracker.state in ("running", "acceptable")}
        if self.share_alpha is not None:
            self._share_at[host] = ts
        cap = self.node_capacity(host)
        views = {j: NodeJob(x.tracker.state == "acceptable", x.use,
                            remaining_work(x.cpu_at_report, x.first, x.tracker.smoothed, x.tracker.targets.objective),
                            x.crossed) for j, x in here.items()}
        plan = node_limits(views, cap, policy=self.policy, shrink=self.shrink, alpha=self.share_alpha,
                           favoured=self._favoured.get(host), host=host)
        if plan.favoured is not None and plan.favoured != self._favoured.get(host):
            self._dirty.update(j for j in (plan.favoured, self._favoured.get(host)) if j is not None)
            self._favoured[host] = plan.favoured
        out = []
        for j in sorted(here):
            job, lim = here[j], plan.limits[j]
            if lim == job.limit:
                continue
            reason = plan.reasons[j]
            if lim is None:
                cores, reason = round(cap, 3), f"released: {reason} (the node's {cap:g} cores)"
            else:
                cores = lim
            job.limit = lim
            self._dirty.add(j)
            container = job.container or j
            out.append(Decision(id=decision_id(TARGETS_POLICY, host, container, cores, None, ts), ts=ts, host=host,
                                container=container, action="limit", policy=TARGETS_POLICY, reason=reason,
                                cpu_limit_cores=cores,
                                details={"rule": self.policy, "share_alpha": self.share_alpha, "capacity": cap,
                                         "jobs": len(here), "state": job.tracker.state, "released": lim is None,
                                         "remaining_cpu_s": views[j].remaining
                                         if views[j].remaining is None or math.isfinite(views[j].remaining) else None,
                                         "use": job.use}))
        return out

    # ------------------------------------------------------------------ state

    def pop_dirty(self) -> list[tuple[str, dict[str, Any] | None]]:
        """``(job, its state or None when no longer followed)`` of the jobs changed since the last call."""
        out = []
        for j in sorted(self._dirty):
            job = self.jobs.get(j)
            if job is None:
                out.append((j, None))
            else:  # with its node's CPU count, so that a restored fleet divides the node as this one would
                out.append((j, {**job.to_state(), "host_cores": self.host_cores.get(job.host or ""),
                                "favoured": job.host is not None and self._favoured.get(job.host) == j}))
        self._dirty.clear()
        return out

    def load(self, job: str, state: Mapping[str, Any]) -> None:
        """Follow *job* again from a state :meth:`pop_dirty` gave (after a restart)."""
        if state.get("v") != FLEET_STATE_VERSION:
            raise ValueError(f"targets job state version {state.get('v')!r}, expected {FLEET_STATE_VERSION}")
        a, o, d, m = state["targets"]
        targets = Targets(acceptable=a, objective=o, direction=d, metric=m)
        self.jobs[job] = _Job(TargetTracker.from_state(targets, self.config, state["tracker"]),
                              host=state["host"], container=state["container"], use=state["use"],
                              cpu_s=state["cpu_s"], sample_ts=state["sample_ts"], first=state["first"],
                              cpu_at_report=state["cpu_at_report"], limit=state["limit"], crossed=state["crossed"],
                              stopping=bool(state.get("stopping", False)))
        if state.get("host_cores") and state["host"] is not None:
            self.host_cores.setdefault(state["host"], float(state["host_cores"]))
        if state.get("favoured") and state["host"] is not None:
            self._favoured[state["host"]] = job

    def clear(self) -> None:
        self.jobs.clear()
        self._favoured.clear()
        self._share_at.clear()
        self._dirty.clear()
