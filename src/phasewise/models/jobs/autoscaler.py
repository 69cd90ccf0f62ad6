"""Inference replica autoscaling from a service's own metrics and its latency SLO, pure (DynamoML's
auto-scaling operator).

:class:`Autoscaler` is the rule: Kubernetes HPA's (``ceil(replicas * util / target_util)`` outside a
tolerance) with a latency term (a p99 over the SLO asks for ``up_step`` more; no scale-down near the SLO),
clamped to ``[min_replicas, max_replicas]``, in steps of at most ``max_step``, with up and down cool-downs;
each :class:`Scale` names the rule that set its number. :func:`service_signal` turns two scrapes of each
replica's Prometheus histogram and CPU counter (:class:`Scrape`) into the p99, request rate and
utilisation of the interval between them, as ``histogram_quantile(0.99, sum(rate(..._bucket[i])) by (le))``
does. :class:`AutoscaleStep` is the agent without Faust: job events in (which services exist, where),
scrape results in, ``scale`` decisions out, its state for the changelogged table. Time comes in as
``now``. Narrative: docs/priorities.md, "Inference autoscaling".

>>> cfg = AutoscalerConfig(slo_p99_ms=100, target_util=0.6, tolerance=0.1, down_latency_fraction=0.5,
...                        min_replicas=1, max_replicas=4, max_step=2, up_step=1, up_cooldown_s=5,
...                        down_cooldown_s=30)
>>> a = Autoscaler(cfg)
>>> s = a.step(now=0, replicas=1, util=0.95, p99_ms=140)
>>> s.replicas, s.rule
(2, 'utilisation')
>>> a.step(now=2, replicas=2, util=0.95, p99_ms=140) is None     # inside the up cool-down
True
>>> a.step(now=40, replicas=2, util=0.1, p99_ms=10).replicas
1
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phasewise.kit.records import Decision, JobEvent, JobService, decode, from_dict, to_dict
from phasewise.models.jobs.events import EventTimeRefused, JobPositions, SignatureRefused
from phasewise.models.jobs.submissions import Submissions
from phasewise.models.safety.intake import EventClock

__all__ = ["ACTS_ON", "ENDS", "Autoscaler", "AutoscalerConfig", "AutoscaleStep", "AutoscaleStepConfig", "Scale",
           "Scrape", "Signal", "Target", "histogram_quantile", "service_signal"]

log = logging.getLogger(__name__)

#: the job-event kinds the step acts on
ACTS_ON = frozenset({"submitted", "started", "scaled", "finished", "failed", "terminated", "rejected", "lost"})
#: the kinds after which a service is forgotten (its replicas are the actuator's to stop)
ENDS = frozenset({"finished", "failed", "terminated", "rejected", "lost"})


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    """The rule's parameters (:func:`phasewise.streams.config.autoscaler_config` maps the ``autoscale_*``
    settings onto them; a service's spec may set its own ``slo_p99_ms``, ``min_replicas``, ``max_replicas``)."""

    slo_p99_ms: float
    target_util: float
    tolerance: float
    down_latency_fraction: float
    min_replicas: int
    max_replicas: int
    max_step: int
    up_step: int
    up_cooldown_s: float
    down_cooldown_s: float

    def __post_init__(self) -> None:
        if not (isinstance(self.min_replicas, int) and isinstance(self.max_replicas, int)
                and 0 <= self.min_replicas <= self.max_replicas):
            raise ValueError(f"need integers 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                             f"{self.max_replicas}")
        for name in ("slo_p99_ms", "target_util"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"AutoscalerConfig.{name} must be > 0, got {v!r}")
        for name in ("tolerance", "down_latency_fraction", "up_cooldown_s", "down_cooldown_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"AutoscalerConfig.{name} must be >= 0, got {v!r}")
        if self.max_step < 1 or self.up_step < 1:
            raise ValueError("AutoscalerConfig.max_step and up_step must be >= 1")

    def for_service(self, svc: JobService, most: int | None = None) -> AutoscalerConfig:
        """This configuration with what *svc*'s spec sets itself (SLO, replica bounds), its maximum no more than
        *most* (the replicas its actuator runs at most, when it said)."""
        lo = svc.min_replicas if svc.min_replicas is not None else self.min_replicas
        hi = svc.max_replicas if svc.max_replicas is not None else self.max_replicas
        if most is not None:
            hi = min(hi, most)
        return dataclasses.replace(self, slo_p99_ms=svc.slo_p99_ms if svc.slo_p99_ms is not None else self.slo_p99_ms,
                                   min_replicas=min(lo, hi), max_replicas=hi)


@dataclass(frozen=True, slots=True)
class Scale:
    """Change a service from ``current`` to ``replicas``, why, and the rule that set the number: ``utilisation``
    (HPA's rule), ``slo`` (p99 over the SLO), ``min_replicas``, ``max_replicas``, ``max_step`` or ``bounds``
    (the service was outside ``[min_replicas, max_replicas]``)."""

    current: int
    replicas: int
    reason: str
    rule: str
    details: dict


class Autoscaler:
    """One service's scaler; its only state is the time of its last change."""

    VERSION = 1

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._last_change: float | None = None

    def desired(self, replicas: int, util: float | None, p99_ms: float | None) -> tuple[int, list[str], str | None]:
        """The replica count the rule wants now, ignoring cool-downs, the reasons and the rule that set it."""
        c = self.config
        why: list[str] = []
        want, rule = replicas, None
        if util is not None and math.isfinite(util) and replicas > 0:
            ratio = util / c.target_util
            if abs(ratio - 1.0) > c.tolerance:
                want, rule = math.ceil(replicas * ratio - 1e-9), "utilisation"
                why.append(f"utilisation {util:.0%} vs target {c.target_util:.0%}")
        over = p99_ms is not None and math.isfinite(p99_ms) and p99_ms > c.slo_p99_ms
        if over:
            why.append(f"p99 {p99_ms:.0f} ms > SLO {c.slo_p99_ms:g} ms")
            if want < replicas + c.up_step:
                want, rule = replicas + c.up_step, "slo"
        if want < replicas:
            calm = p99_ms is None or (math.isfinite(p99_ms) and p99_ms <= c.down_latency_fraction * c.slo_p99_ms)
            if not calm:
                why.append(f"no scale-down: p99 {p99_ms:.0f} ms > {c.down_latency_fraction:g} x SLO")
                want, rule = replicas, None
        bounds: tuple[tuple[str, Callable[[int], int]], ...] = (
            ("max_replicas", lambda w: min(c.max_replicas, w)), ("min_replicas", lambda w: max(c.min_replicas, w)),
            ("max_step", lambda w: max(replicas - c.max_step, min(replicas + c.max_step, w))))
        for bound, clamp in bounds:
            value = clamp(want)
            if value != want:
                want, rule = value, bound
                why.append(f"bounded by {bound} ({getattr(c, bound)})")
        return want, why, rule

    def step(self, *, now: float, replicas: int, util: float | None, p99_ms: float | None) -> Scale | None:
        """A :class:`Scale` when the service should change now, else ``None``."""
        c = self.config
        want, why, rule = self.desired(replicas, util, p99_ms)
        if replicas < c.min_replicas or replicas > c.max_replicas:  # bounds first, no cool-down
            want = max(c.min_replicas, min(c.max_replicas, replicas))
            why, rule = [f"outside [{c.min_replicas}, {c.max_replicas}]"], "bounds"
        elif want == replicas:
            return None
        else:
            since = math.inf if self._last_change is None else now - self._last_change
            cool = c.up_cooldown_s if want > replicas else c.down_cooldown_s
            if since < cool:
                return None
        self._last_change = now
        details = {"util": util, "p99_ms": p99_ms, "slo_p99_ms": c.slo_p99_ms, "target_util": c.target_util,
                   "min_replicas": c.min_replicas, "max_replicas": c.max_replicas}
        return Scale(replicas, want, f"scale {replicas} -> {want}: " + "; ".join(why), rule or "bounds", details)

    def to_state(self) -> dict:
        return {"v": self.VERSION, "last_change": self._last_change}

    @classmethod
    def from_state(cls, config: AutoscalerConfig, state: dict) -> Autoscaler:
        if state.get("v") != cls.VERSION:
            raise ValueError(f"Autoscaler state version {state.get('v')!r} is not {cls.VERSION}")
        a = cls(config)
        a._last_change = state["last_change"]
        return a


# --------------------------------------------------------------------------- the signal


@dataclass(frozen=True, slots=True)
class Scrape:
    """One replica's metrics at time ``t``: its latency histogram's cumulative buckets ``(le, count)``
    (``le`` in seconds, ascending, the last ``inf``; empty: the histogram is absent), its request count and
    its CPU seconds (``None``: absent)."""

    t: float
    buckets: tuple[tuple[float, float], ...] = ()
    count: float | None = None
    cpu_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Signal:
    """A service over one interval: its p99 (ms), request rate (/s) and CPU utilisation (of the replicas'
    request), each ``None`` where unknown, and how many replicas answered."""

    p99_ms: float | None
    rate_rps: float | None
    util: float | None
    answered: int


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The *q* quantile of cumulative *buckets* ``(le, count)``, interpolated linearly inside its bucket as
    Prometheus' ``histogram_quantile`` does (the ``+Inf`` bucket answers with the highest finite bound);
    ``None`` when no observation was counted.

    >>> round(histogram_quantile(0.5, [(0.1, 10), (0.2, 30), (float("inf"), 30)]), 6)   # rank 15 of 30
    0.125
    >>> histogram_quantile(0.99, [(0.1, 0), (0.2, 1), (float("inf"), 5)])
    0.2
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_bound
            if count == lo_count:
                return le
            return lo_bound + (le - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = le, count
    return lo_bound


def _delta(cur: float, prev: float) -> float:
    """A counter's increase; a counter that went down was reset (the replica restarted): its value is the increase."""
    return cur - prev if cur >= prev else cur


def service_signal(pairs: list[tuple[Scrape | None, Scrape | None]], cpu_cores: float | None,
                   q: float = 0.99) -> Signal:
    """The service's :class:`Signal` from ``(previous, current)`` scrapes of each replica (``None``: it did
    not answer). Histograms are summed by bucket over the replicas that answered both times (a replica's
    buckets must match to be summed); utilisation is the CPU seconds per second of those replicas over
    their *cpu_cores* each (``None``: no CPU request, no utilisation)."""
    answered = sum(1 for _, cur in pairs if cur is not None)
    summed: dict[float, float] = {}
    layout: tuple[float, ...] | None = None
    reqs = span_n = 0.0
    cpu_rates: list[float] = []
    for prev, cur in pairs:
        if prev is None or cur is None or cur.t <= prev.t:
            continue
        dt = cur.t - prev.t
        if cur.buckets and len(cur.buckets) == len(prev.buckets) and \
                [le for le, _ in cur.buckets] == [le for le, _ in prev.buckets]:
            les = tuple(le for le, _ in cur.buckets)
            if layout is None or layout == les:
                layout = les
                for (le, c), (_, p) in zip(cur.buckets, prev.buckets, strict=True):
                    summed[le] = summed.get(le, 0.0) + _delta(c, p)
        if cur.count is not None and prev.count is not None:
            reqs += _delta(cur.count, prev.count) / dt
            span_n += 1
        if cur.cpu_seconds is not None and prev.cpu_seconds is not None and cpu_cores:
            cpu_rates.append(_delta(cur.cpu_seconds, prev.cpu_seconds) / dt / cpu_cores)
    p99 = histogram_quantile(q, sorted(summed.items())) if summed else None
    return Signal(p99_ms=None if p99 is None else p99 * 1e3, rate_rps=reqs if span_n else None,
                  util=sum(cpu_rates) / len(cpu_rates) if cpu_rates else None, answered=answered)


# --------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class AutoscaleStepConfig:
    """The autoscaler agent's parameters (:func:`phasewise.streams.config.autoscale_step_config`)."""

    #: the rule's defaults (a service's spec may set its SLO and bounds)
    scaler: AutoscalerConfig
    #: the latency histogram a service's spec names none of
    latency_metric: str
    #: the CPU seconds counter of each replica
    cpu_metric: str
    #: the job-events topic's partition count (a service's state goes to its events' changelog partition)
    partitions: int


@dataclass(frozen=True, slots=True)
class Target:
    """Where a service's metrics are read: each URL one replica's endpoint (or the whole service's)."""

    job: str
    urls: tuple[str, ...]
    latency_metric: str
    cpu_metric: str


class AutoscaleStep:
    """Raw job-event records and scrape results -> ``scale`` decisions (the agent without Faust), and its state.

    A service is a ``submitted`` inference job whose spec has a ``service`` section, signed by a trusted
    submitter (*submissions*); it is scaled once a ``started`` event (with a cluster key: signed by it,
    *verify*) says where it runs, and forgotten when it ends. Each :meth:`decide` round scales each
    service from the :class:`Signal` of its replicas' scrapes.
    """

    def __init__(self, config: AutoscaleStepConfig, submissions: Submissions, *, clock: EventClock | None = None,
                 now: Callable[[], float] | None = None,
                 verify: Callable[[bytes | None, bytes | None, Any], str | None] | None = None) -> None:
        if clock is not None and now is None:
            raise ValueError("an event-time rule needs the worker's clock (now)")
        self.config, self.submissions, self.clock, self.now, self.verify = config, submissions, clock, now, verify
        #: job -> {"sub": start details, "svc": service, "host", "ctr", "n": replicas, "sc": scaler state}
        self.services: dict[str, dict[str, Any]] = {}
        self.scalers: dict[str, Autoscaler] = {}
        #: job -> each replica URL's last scrape (not kept in the table: a restored service starts a new interval)
        self.last: dict[str, dict[str, Scrape]] = {}
        self.positions = JobPositions(config.partitions)
        self._dirty: set[str] = set()
        #: submissions not followed, by why (two reasons: not a service, not signed by a trusted submitter)
        self.ignored: dict[str, int] = {}
        self.replayed = 0

    # ------------------------------------------------------------------ job events

    def handle(self, raw: bytes | None, partition: int | None = None, offset: int | None = None, *,
               key: bytes | None = None, headers: Any = None) -> None:
        """Take one job-events record; raises :class:`SchemaError` or :class:`Refused` for a dead letter."""
        ev = decode(JobEvent, raw)
        if ev.kind not in ACTS_ON:
            return
        if ev.kind != "submitted" and ev.job not in self.services:
            return  # not a service this step follows
        if ev.kind == "submitted" and (ev.workload != "inference" or ev.spec is None or ev.spec.service is None):
            self._ignore("not an inference service", ev.job)  # (its time is none of this step's concern)
            return
        if ev.kind in ("started", "scaled") and self.verify is not None:
            why = self.verify(key, raw, headers)
            if why is not None:  # only the actuator that started it says where the service runs, and how many
                raise SignatureRefused(f"JobEvent {ev.kind} {ev.job}: not signed by the cluster key ({why}): where "
                                       f"the service runs is not taken", "signature")
        if self.positions.seen(ev.job, partition, offset):
            self.replayed += 1
            return
        if self.clock is not None and (why := self.clock.admit(ev.job, ev.ts, now=self.now())) is not None:
            raise EventTimeRefused(f"JobEvent {ev.kind} {ev.job}: {why}")
        if ev.kind == "submitted":
            if not self._submitted(ev):
                return
        elif ev.kind == "started":
            s = self.services[ev.job]
            s["host"], s["ctr"], s["n"] = ev.host, ev.container or ev.job, 1
        elif ev.kind == "scaled":
            self._scaled(ev)
        elif ev.kind in ENDS:
            self._forget(ev.job)
            return
        self.positions.note(ev.job, partition, offset)
        self._dirty.add(ev.job)

    def _scaled(self, ev: JobEvent) -> None:
        """The actuator's count of the replicas running now, and the most it runs: they replace what the
        last decision asked for (a cap, a replica that did not start or ended on its own)."""
        s = self.services[ev.job]
        if s["host"] is None:
            return  # (a scaled state before its started one: the started one says where it runs)
        if ev.replicas is not None and ev.replicas != s["n"]:
            log.info("autoscaler: service %s runs %d replica(s), not %s%s", ev.job, ev.replicas, s["n"],
                     f" ({ev.reason})" if ev.reason else "")
            s["n"] = ev.replicas
        if ev.max_replicas is not None and ev.max_replicas != s.get("most"):
            s["most"] = ev.max_replicas
            self.scalers.pop(ev.job, None)  # its bounds change (its last change stays in the state)

    def _ignore(self, why: str, job: str) -> None:
        self.ignored[why] = self.ignored.get(why, 0) + 1
        if job in self.services:  # submitted again as something else
            self._forget(job)

    def _submitted(self, ev: JobEvent) -> bool:
        assert ev.spec is not None and ev.spec.service is not None
        why = self.submissions.check(ev) if self.submissions.check is not None else None
        if why is not None:
            log.info("autoscaler: service %s not followed: %s", ev.job, why)
            self._ignore("no trusted submitter signed it", ev.job)
            return False
        self.services[ev.job] = {"sub": self.submissions.details(ev), "svc": to_dict(ev.spec.service),
                                 "cores": ev.spec.requests.cpu_cores, "host": None, "ctr": None, "n": None}
        self.scalers.pop(ev.job, None)
        self.last.pop(ev.job, None)
        return True

    def _forget(self, job: str) -> None:
        if self.services.pop(job, None) is not None:
            self._dirty.add(job)
        self.scalers.pop(job, None)
        self.last.pop(job, None)

    # ------------------------------------------------------------------ scrapes and decisions

    def service(self, job: str) -> JobService:
        return from_dict(JobService, self.services[job]["svc"])

    def targets(self) -> list[Target]:
        """What to scrape now: each running service's replica endpoints (127.0.0.1, port + k for each of its
        replicas k), or its ``metrics_url``."""
        out = []
        for job, s in sorted(self.services.items()):
            if s["host"] is None:
                continue
            svc = self.service(job)
            urls = (svc.metrics_url,) if svc.metrics_url else tuple(
                f"http://127.0.0.1:{svc.port + k}{svc.metrics_path}" for k in range(1, s["n"] + 1))
            out.append(Target(job, urls, svc.latency_metric or self.config.latency_metric, self.config.cpu_metric))
        return out

    def _scaler(self, job: str) -> Autoscaler:
        a = self.scalers.get(job)
        if a is None:
            cfg = self.config.scaler.for_service(self.service(job), most=self.services[job].get("most"))
            st = self.services[job].get("sc")
            a = self.scalers[job] = Autoscaler.from_state(cfg, st) if st else Autoscaler(cfg)
        return a

    def decide(self, now: float, scrapes: dict[str, dict[str, Scrape | None]]) -> list[Decision]:
        """The ``scale`` decisions of one round: *scrapes* holds, per service, each URL's scrape (``None``:
        it did not answer). A service whose replicas gave no signal is left as it is (no data, no change),
        except to bring it inside its bounds."""
        out = []
        for job, got in sorted(scrapes.items()):
            s = self.services.get(job)
            if s is None or s["host"] is None:
                continue
            last = self.last.setdefault(job, {})
            pairs = [(last.get(url), cur) for url, cur in got.items()]
            for url, cur in got.items():
                if cur is not None:
                    last[url] = cur
            sig = service_signal(pairs, s["cores"])
            scaler = self._scaler(job)
            sc = scaler.step(now=now, replicas=s["n"], util=sig.util, p99_ms=sig.p99_ms)
            if sc is None:
                continue
            s["n"], s["sc"] = sc.replicas, scaler.to_state()
            self._dirty.add(job)
            out.append(self._decision(job, s, sc, sig, now))
        return out

    def _decision(self, job: str, s: dict, sc: Scale, sig: Signal, now: float) -> Decision:
        ident = hashlib.sha256(json.dumps([job, now, sc.current, sc.replicas]).encode()).hexdigest()[:24]
        details = {**s["sub"], **sc.details, "replicas": sc.replicas, "current": sc.current, "rule": sc.rule,
                   "rate_rps": sig.rate_rps, "answered": sig.answered, "service": s["svc"]}
        return Decision(id=f"scale-{ident}", ts=now, host=s["host"], container=s["ctr"], action="scale",
                        policy="autoscaler", reason=sc.reason, details=details)

    # ------------------------------------------------------------------ state

    def writes(self) -> list[tuple[str, int, bytes | None]]:
        """``(key, changelog partition, value or None)`` of the services changed since the last call."""
        out = []
        for job in sorted(self._dirty):
            p = self.positions.partition(job)
            s = self.services.get(job)
            value = None if s is None else json.dumps({"p": p, "o": self.positions.offset(job), "s": s},
                                                      separators=(",", ":")).encode()
            out.append((job, p, value))
            if s is None:
                self.positions.forget(job)
        self._dirty.clear()
        return out

    def restore(self, items: Any) -> int:
        """Follow again the services of the table's ``(key, value)`` items; how many."""
        self.services.clear()
        self.scalers.clear()
        self.last.clear()
        self.positions.clear()
        for job, raw in items:
            if raw is None:
                continue
            try:
                v = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
                from_dict(JobService, v["s"]["svc"])  # a state this version cannot read is dropped here
                self.services[job] = v["s"]
                self.positions.load(job, v["p"], v.get("o"))
            except (ValueError, KeyError, TypeError) as e:
                log.error("autoscaler: cannot restore service %s (%s); it is followed again from its next "
                          "submitted event", job, e)
        self._dirty.clear()
        return len(self.services)
