"""A VPA-faithful reactive recommender for one container (:class:`VpaRecommender`), and its limit policy.

It reproduces the Kubernetes Vertical Pod Autoscaler's recommender at a
pinned upstream commit, in river's grammar, plus one addition of
phasewise's (throttled CPU samples are censored); :class:`VpaPolicy` wraps
it in the :class:`~phasewise.models.policy.LimitPolicy` contract for the
worker and for replay. The rules, the estimators and ``time_scale``:
docs/vpa.md, "The recommender".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from phasewise.models.policy import RESOURCES, Limits, Usage
from phasewise.models.vpa.histogram import DecayingHistogram, ExponentialBuckets

__all__ = [
    "STATE_VERSION",
    "ConfidenceMultiplier",
    "Estimator",
    "MarginEstimator",
    "MinResourceEstimator",
    "PercentileEstimator",
    "VpaPolicy",
    "VpaRecommender",
    "VpaStateError",
    "confidence",
]

#: 2: CPU samples weigh ``min_sample_weight`` each (1: the limit in force; loaded by :func:`_cpu_state_from_v1`)
STATE_VERSION = 2
DAY_S = 86_400.0
MIB = 2**20
BOUNDS = ("target", "lower", "upper")


class VpaStateError(ValueError):
    """A serialised recommender cannot be loaded; ``str(e)`` says why."""


# --------------------------------------------------------------------------- estimators


class Estimator(Protocol):
    """One resource amount from a recommender's aggregated state."""

    def __call__(self, s: VpaRecommender) -> float: ...


def confidence(s: VpaRecommender, interval_s: float) -> float:
    """VPA's ``getConfidence``: how much history backs the estimate.

    ``min(span of CPU samples / interval, CPU samples / interval-in-minutes)``;
    equals N for N intervals of one sample per minute.
    """
    if s._n == 0:
        return 0.0
    lifespan = (s._last_t - s._first_t) / interval_s  # type: ignore[operator]
    samples = s._n / (interval_s / 60.0)
    return min(lifespan, samples)


@dataclass(frozen=True, slots=True)
class PercentileEstimator:
    """The given percentile of the CPU histogram or of the memory peaks."""

    resource: str  # "cpu" | "mem"
    percentile: float

    def __call__(self, s: VpaRecommender) -> float:
        return s._percentile(self.resource, self.percentile)


@dataclass(frozen=True, slots=True)
class MarginEstimator:
    """``base * (1 + margin)``."""

    margin: float
    base: Estimator

    def __call__(self, s: VpaRecommender) -> float:
        v = self.base(s)
        return v + v * self.margin


@dataclass(frozen=True, slots=True)
class ConfidenceMultiplier:
    """``base * (1 + multiplier / confidence) ** exponent`` (no history: inf or 0)."""

    multiplier: float
    exponent: float
    interval_s: float
    base: Estimator

    def __call__(self, s: VpaRecommender) -> float:
        c = confidence(s, self.interval_s)
        v = self.base(s)
        if c <= 0:
            factor = math.inf if self.exponent > 0 else (0.0 if self.exponent < 0 else 1.0)
        else:
            factor = (1.0 + self.multiplier / c) ** self.exponent
        if v == 0 and math.isinf(factor):
            return 0.0
        return v * factor


@dataclass(frozen=True, slots=True)
class MinResourceEstimator:
    """``max(base, minimum)``."""

    minimum: float
    base: Estimator

    def __call__(self, s: VpaRecommender) -> float:
        v = self.base(s)
        return max(self.minimum, v)


#: VPA's confidence multipliers ``(multiplier, exponent)``: bound * (1 + multiplier / confidence) ** exponent
LOWER_CONFIDENCE = (0.001, -2.0)
UPPER_CONFIDENCE = (1.0, 1.0)


@lru_cache(maxsize=64)
def _estimators(
    target_p: float, lower_p: float, upper_p: float, margin: float,
    min_cpu: float, min_mem: float, conf_interval_s: float,
) -> dict[tuple[str, str], Estimator]:
    """The six estimators of VPA's ``CreatePodResourceRecommender``, shared by instances."""
    out: dict[tuple[str, str], Estimator] = {}
    for res, floor in (("cpu", min_cpu), ("mem", min_mem)):
        target: Estimator = MarginEstimator(margin, PercentileEstimator(res, target_p))
        lower: Estimator = MarginEstimator(margin, PercentileEstimator(res, lower_p))
        upper: Estimator = MarginEstimator(margin, PercentileEstimator(res, upper_p))
        upper = ConfidenceMultiplier(*UPPER_CONFIDENCE, conf_interval_s, upper)
        lower = ConfidenceMultiplier(*LOWER_CONFIDENCE, conf_interval_s, lower)
        out[(res, "target")] = MinResourceEstimator(floor, target)
        out[(res, "lower")] = MinResourceEstimator(floor, lower)
        out[(res, "upper")] = MinResourceEstimator(floor, upper)
    return out


@lru_cache(maxsize=64)
def _buckets(first: float, ratio: float, max_value: float, epsilon: float) -> ExponentialBuckets:
    return ExponentialBuckets(first, ratio, max_value, epsilon)


# --------------------------------------------------------------------------- recommender


class VpaRecommender:
    """VPA's recommendation for one container, learned online.

    Parameters
    ----------
    target_percentile, lower_percentile, upper_percentile
        CPU / memory-peak percentiles behind the target and bounds (VPA: 0.9, 0.5, 0.95).
    safety_margin
        Fraction added to every estimate (VPA: 0.15).
    min_cpu_cores, min_mem_bytes
        Floors of every estimate (VPA: 25 millicores, 250 MiB).
    cpu_first_bucket, mem_first_bucket, bucket_ratio, cpu_max, mem_max, epsilon
        Histogram bucketing (VPA: 0.01 cores / 1e7 bytes, 1.05, 1000 cores /
        1e12 bytes, 1e-4).
    min_sample_weight
        Weight of every CPU sample (VPA's ``minSampleWeight``: 0.1; > 0).
    cpu_half_life_s, mem_half_life_s
        Decay half-lives in seconds (VPA: 24 h), before ``time_scale``.
    mem_aggregation_interval_s
        One memory peak per this interval (VPA: 24 h), before ``time_scale``.
    confidence_interval_s
        History length that counts as confidence 1 (VPA: 24 h), before ``time_scale``.
    oom_bump_ratio, oom_min_bump_bytes
        OOM peak = ``max(used * ratio, used + min_bump)`` (VPA: 1.2, 100 MiB).
    throttle_threshold, throttle_bump
        phasewise's addition: a sample throttled in more than this fraction of
        CFS periods is recorded as ``max(usage, limit * (1 + bump))``.
    time_scale
        Multiplies every duration above (1 = VPA; 0.001 = a day in 86.4 s).

    Examples
    --------
    A container using a steady 1.0 core under a 2-core limit for an hour
    (``time_scale`` shrinks VPA's days to 86.4 s so the confidence is high):

    >>> r = VpaRecommender(time_scale=0.001)
    >>> for i in range(3600):
    ...     r.learn_one({"t": float(i), "cpu": 1.0, "mem": 5e8, "cpu_limit": 2.0})
    >>> rec = r.predict_one()
    >>> round(rec["cpu"]["target"], 4)     # end of 1.0's bucket (1.0163) * 1.15
    1.1687
    >>> round(rec["cpu"]["lower"], 4), round(rec["cpu"]["upper"], 4)  # upper * (1 + 1/41.65)
    (1.1687, 1.1968)
    >>> rec["mem"]["target"] > 5e8
    True
    """

    __slots__ = (
        "_cpu",
        "_first_t",
        "_last_cpu_t",
        "_last_mem_t",
        "_last_t",
        "_mem",
        "_mem_peak",
        "_n",
        "_n_mem",
        "_n_oom",
        "_n_throttled",
        "_oom_peak",
        "_pc",
        "_window_end",
        "bucket_ratio",
        "confidence_interval_s",
        "cpu_first_bucket",
        "cpu_half_life_s",
        "cpu_max",
        "epsilon",
        "lower_percentile",
        "mem_aggregation_interval_s",
        "mem_first_bucket",
        "mem_half_life_s",
        "mem_max",
        "min_cpu_cores",
        "min_mem_bytes",
        "min_sample_weight",
        "oom_bump_ratio",
        "oom_min_bump_bytes",
        "safety_margin",
        "target_percentile",
        "throttle_bump",
        "throttle_threshold",
        "time_scale",
        "upper_percentile",
    )

    def __init__(
        self,
        *,
        target_percentile: float = 0.9,
        lower_percentile: float = 0.5,
        upper_percentile: float = 0.95,
        safety_margin: float = 0.15,
        min_cpu_cores: float = 0.025,
        min_mem_bytes: float = 250 * MIB,
        cpu_first_bucket: float = 0.01,
        mem_first_bucket: float = 1e7,
        bucket_ratio: float = 1.05,
        cpu_max: float = 1000.0,
        mem_max: float = 1e12,
        epsilon: float = 1e-4,
        min_sample_weight: float = 0.1,
        cpu_half_life_s: float = DAY_S,
        mem_half_life_s: float = DAY_S,
        mem_aggregation_interval_s: float = DAY_S,
        confidence_interval_s: float = DAY_S,
        oom_bump_ratio: float = 1.2,
        oom_min_bump_bytes: float = 100 * MIB,
        throttle_threshold: float = 0.1,
        throttle_bump: float = 0.5,
        time_scale: float = 1.0,
    ) -> None:
        for name, p in (("target_percentile", target_percentile), ("lower_percentile", lower_percentile),
                        ("upper_percentile", upper_percentile)):
            if not 0 <= p <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if safety_margin < 0 or throttle_bump < 0 or min_cpu_cores < 0 or min_mem_bytes < 0:
            raise ValueError("safety_margin, throttle_bump and the floors must be >= 0")
        if not 0 < min_sample_weight < math.inf:
            raise ValueError(f"min_sample_weight must be a finite number > 0, got {min_sample_weight}")
        self.target_percentile = target_percentile
        self.lower_percentile = lower_percentile
        self.upper_percentile = upper_percentile
        self.safety_margin = safety_margin
        self.min_cpu_cores = min_cpu_cores
        self.min_mem_bytes = min_mem_bytes
        self.cpu_first_bucket = cpu_first_bucket
        self.mem_first_bucket = mem_first_bucket
        self.bucket_ratio = bucket_ratio
        self.cpu_max = cpu_max
        self.mem_max = mem_max
        self.epsilon = epsilon
        self.min_sample_weight = min_sample_weight
        self.cpu_half_life_s = cpu_half_life_s
        self.mem_half_life_s = mem_half_life_s
        self.mem_aggregation_interval_s = mem_aggregation_interval_s
        self.confidence_interval_s = confidence_interval_s
        self.oom_bump_ratio = oom_bump_ratio
        self.oom_min_bump_bytes = oom_min_bump_bytes
        self.throttle_threshold = throttle_threshold
        self.throttle_bump = throttle_bump
        self.time_scale = time_scale
        self._cpu = DecayingHistogram(
            _buckets(cpu_first_bucket, bucket_ratio, cpu_max, epsilon), cpu_half_life_s * time_scale)
        self._mem = DecayingHistogram(
            _buckets(mem_first_bucket, bucket_ratio, mem_max, epsilon), mem_half_life_s * time_scale)
        self._first_t: float | None = None  # first / last CPU sample time (VPA: FirstSampleStart ...)
        self._last_t: float | None = None
        self._n = 0  # CPU samples aggregated (VPA: TotalSamplesCount)
        self._last_cpu_t: float | None = None
        self._last_mem_t: float | None = None
        self._window_end: float | None = None  # end of the current memory aggregation interval
        self._mem_peak = 0.0
        self._oom_peak = 0.0
        self._n_oom = 0
        self._n_throttled = 0
        self._n_mem = 0
        self._pc: dict[tuple[str, float], float] | None = None  # percentiles since the last update

    # ------------------------------------------------------------------ learning

    @property
    def _mem_interval(self) -> float:
        return self.mem_aggregation_interval_s * self.time_scale

    def learn_one(self, x: Mapping[str, Any]) -> None:
        """Learn one sample.

        ``x``: ``t`` (event time, s; required), ``cpu`` (cores), ``mem`` (bytes),
        ``oom`` (OOM kills since the last sample), ``throttled_frac`` (share of
        CFS periods throttled), ``throttled_cores`` (CFS throttled seconds per
        second), ``cpu_limit`` (cores; what a throttled sample is raised to
        exceed) and ``mem_limit`` (bytes; the base of an OOM's bumped peak);
        any of the optional keys may be missing or ``None``.
        """
        t = x["t"]
        self._pc = None
        if not math.isfinite(t):
            raise ValueError(f"sample time must be finite, got {t!r}")
        cpu = x.get("cpu")
        if cpu is not None:
            if not cpu >= 0 or cpu == math.inf:
                raise ValueError(f"cpu must be a finite number >= 0, got {cpu!r}")
            self._add_cpu(t, cpu, x.get("cpu_limit"), x.get("throttled_frac"), x.get("throttled_cores"))
        mem = x.get("mem")
        if mem is not None:
            if not mem >= 0 or mem == math.inf:
                raise ValueError(f"mem must be a finite number >= 0, got {mem!r}")
            self._add_memory(t, float(mem), is_oom=False)
        if x.get("oom"):
            self.record_oom(t, x.get("mem_limit") or 0.0)

    def _add_cpu(self, t: float, cpu: float, limit: float | None, throttled: float | None,
                 throttled_cores: float | None = None) -> bool:
        if self._last_cpu_t is not None and t <= self._last_cpu_t:
            return False  # duplicate or out of order (VPA discards these)
        value = cpu
        if limit and throttled is not None and throttled > self.throttle_threshold:
            value = max(value, limit * (1.0 + self.throttle_bump))
            if throttled_cores:
                value = max(value, cpu + throttled_cores)
            self._n_throttled += 1
        self._cpu.add(value, self.min_sample_weight, t)
        self._last_cpu_t = t
        if self._last_t is None or t > self._last_t:
            self._last_t = t
        if self._first_t is None or t < self._first_t:
            self._first_t = t
        self._n += 1
        return True

    def _add_memory(self, t: float, usage: float, is_oom: bool) -> bool:
        if not is_oom and self._last_mem_t is not None and t < self._last_mem_t:
            return False  # outdated
        self._last_mem_t = t
        if self._window_end is None:
            self._window_end = t
        add_new = False
        if t < self._window_end:
            old = max(self._mem_peak, self._oom_peak)
            if old != 0 and usage > old:
                self._mem.subtract(old, 1.0, self._window_end)
                add_new = True
        else:  # move the window to the interval holding t
            step = self._mem_interval
            self._window_end += math.floor((t - self._window_end) / step) * step + step
            self._mem_peak = 0.0
            self._oom_peak = 0.0
            add_new = True
            self._n_mem += 1
        if add_new:
            self._mem.add(usage, 1.0, self._window_end)
            if is_oom:
                self._oom_peak = usage
            else:
                self._mem_peak = usage
        return True

    def record_oom(self, t: float, mem_limit: float = 0.0) -> bool:
        """An OOM kill at *t*: add the bumped-up peak VPA's ``RecordOOM`` adds.

        Returns ``False`` when the event is more than one memory aggregation
        interval older than the last memory sample (VPA discards those).
        """
        if self._last_mem_t is not None and t < self._last_mem_t - self._mem_interval:
            return False
        self._pc = None
        used = max(self._mem_peak, mem_limit)
        needed = max(used + self.oom_min_bump_bytes, used * self.oom_bump_ratio)
        self._n_oom += 1
        return self._add_memory(t, needed, is_oom=True)

    # ------------------------------------------------------------------ prediction

    def _percentile(self, resource: str, p: float) -> float:
        """Percentile of the CPU histogram or memory peaks, memoised until the next update."""
        pc = self._pc
        if pc is None:
            ps = (self.lower_percentile, self.target_percentile, self.upper_percentile)
            pc = self._pc = {}
            for res, h in (("cpu", self._cpu), ("mem", self._mem)):
                for q, v in zip(ps, h.percentiles(ps)):
                    pc[(res, q)] = v
        v = pc.get((resource, p))
        if v is None:
            h = self._cpu if resource == "cpu" else self._mem
            v = pc[(resource, p)] = h.percentile(p)
        return v

    def _estimator_set(self) -> dict[tuple[str, str], Estimator]:
        return _estimators(self.target_percentile, self.lower_percentile, self.upper_percentile,
                           self.safety_margin, self.min_cpu_cores, self.min_mem_bytes,
                           self.confidence_interval_s * self.time_scale)

    def predict_one(self, x: Mapping[str, Any] | None = None) -> dict[str, dict[str, float | None]]:
        """``{"cpu": {"target", "lower", "upper"}, "mem": {...}}`` in cores / bytes.

        A resource with no samples yet has ``None`` everywhere. With little
        history the upper bound may be ``inf`` (VPA: "no history: *INF").
        """
        est = self._estimator_set()
        out: dict[str, dict[str, float | None]] = {}
        for res, h in (("cpu", self._cpu), ("mem", self._mem)):
            if h.is_empty():
                out[res] = {b: None for b in BOUNDS}
            else:
                out[res] = {b: est[(res, b)](self) for b in BOUNDS}
        return out

    def estimate(self, resource: str, bound: str = "target") -> float | None:
        """One number of :meth:`predict_one` (``None`` before any sample of *resource*)."""
        h = self._cpu if resource == "cpu" else self._mem
        if h.is_empty():
            return None
        return self._estimator_set()[(resource, bound)](self)

    def confidence(self) -> float:
        """History behind the bounds, in confidence intervals (VPA days when time_scale=1)."""
        return confidence(self, self.confidence_interval_s * self.time_scale)

    def explain(self) -> dict[str, Any]:
        """The numbers behind a recommendation: raw percentiles, counts, confidence."""
        ps = (self.lower_percentile, self.target_percentile, self.upper_percentile)
        cpu = [self._percentile("cpu", p) for p in ps]
        mem = [self._percentile("mem", p) for p in ps]
        return {
            "cpu_percentiles": {f"p{round(p * 100):g}": v for p, v in zip(ps, cpu)},
            "mem_peak_percentiles": {f"p{round(p * 100):g}": v for p, v in zip(ps, mem)},
            "cpu_samples": self._n,
            "mem_peaks": self._n_mem,
            "oom_events": self._n_oom,
            "throttled_samples": self._n_throttled,
            "history_s": 0.0 if self._n == 0 else self._last_t - self._first_t,  # type: ignore[operator]
            "confidence": self.confidence(),
            "safety_margin": self.safety_margin,
        }

    @property
    def samples(self) -> int:
        return self._n

    # ------------------------------------------------------------------ state

    def to_state(self) -> dict[str, Any]:
        """Compact JSON-able learned state (no constructor arguments)."""
        return {
            "v": STATE_VERSION,
            "c": self._cpu.to_state(),
            "m": self._mem.to_state(),
            "f": self._first_t, "l": self._last_t, "n": self._n,
            "lc": self._last_cpu_t, "lm": self._last_mem_t, "we": self._window_end,
            "mp": self._mem_peak, "op": self._oom_peak,
            "no": self._n_oom, "nt": self._n_throttled, "nm": self._n_mem,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], **params: Any) -> VpaRecommender:
        """A recommender built with *params* holding the learned *state*.

        Reads this version's states and version 1's, whose CPU samples were
        weighted by the limit in force: see :func:`_cpu_state_from_v1`.
        """
        if not isinstance(state, Mapping):
            raise VpaStateError(f"VPA state must be an object, got {type(state).__name__}")
        version = state.get("v")
        if version not in (1, STATE_VERSION):
            raise VpaStateError(f"unsupported VPA state version {version!r} (this build reads v1 and v{STATE_VERSION})")
        r = cls(**params)
        try:
            cpu = state["c"] if version == STATE_VERSION else _cpu_state_from_v1(state, r)
            r._cpu.load_state(cpu)
            r._mem.load_state(state["m"])
            r._first_t, r._last_t, r._n = state["f"], state["l"], int(state["n"])
            r._last_cpu_t, r._last_mem_t, r._window_end = state["lc"], state["lm"], state["we"]
            # (null: a peak that was not a finite number, stored as "none seen")
            r._mem_peak, r._oom_peak = (0.0 if state[k] is None else float(state[k]) for k in ("mp", "op"))
            r._n_oom, r._n_throttled, r._n_mem = int(state["no"]), int(state["nt"]), int(state["nm"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise VpaStateError(f"VPA state is malformed: {e}") from e
        return r

    def __repr__(self) -> str:
        return f"VpaRecommender(samples={self._n}, time_scale={self.time_scale:g})"


def _cpu_state_from_v1(state: Mapping[str, Any], r: VpaRecommender) -> dict[str, Any]:
    """A version-1 CPU histogram state, rescaled to weigh what version 2 gives its samples.

    Version 1 weighted each CPU sample by the CPU limit in force (at least
    ``min_sample_weight``), so its history would outweigh new samples by the
    ratio of the old limits to ``min_sample_weight`` until it decays. The
    limits are not stored; the bucket proportions are kept and the total
    weight is set to what the same number of samples (``n``), spread evenly
    between the first and the last one, weigh at ``min_sample_weight`` each
    (decayed to the histogram's reference time): exact for evenly spaced
    samples, and old history counts about as much as new history again.
    """
    c = state["c"]
    ref, n, first, last = c["r"], int(state["n"]), state["f"], state["l"]
    if ref is None or n <= 0 or first is None or last is None:
        return c
    hl = r._cpu.half_life
    x = (last - first) / max(n - 1, 1) / hl * math.log(2.0)  # ln of the decay ratio between neighbours
    # sum over k < n of 2 ** ((last - ref) / hl) * exp(-k * x), the newest sample first
    spread = n if x <= 0 else math.expm1(-n * x) / math.expm1(-x)
    total = r.min_sample_weight * 2.0 ** ((last - ref) / hl) * spread
    return {**c, "t": float(f"{total:.9g}")}


# --------------------------------------------------------------------------- policy


class VpaPolicy:
    """The :class:`~phasewise.models.policy.LimitPolicy` backed by :class:`VpaRecommender`.

    ``limits(t)`` returns the chosen ``bound`` (``"target"`` by default) of the
    recommendation learned from everything observed before *t*; ``observe``
    feeds the usage measured at *t*. The limits in force when it was
    measured (what a throttled CPU sample is raised above, and the base of an
    OOM's bumped peak) are ``usage["cpu_limit"]`` / ``usage["mem_limit"]``
    if given, else the limits this policy itself returned for that step.

    Besides ``cpu`` and ``mem``, ``usage`` may carry what a live sampler
    measures and a replayed trace does not: ``oom``, ``throttled_frac``,
    ``throttled_cores``, ``cpu_limit`` and ``mem_limit`` (see
    :meth:`VpaRecommender.learn_one`). The live worker
    (:mod:`phasewise.models.vpa.updater`) drives this same class with them,
    so replay and the worker run one decision code path.

    Parameters
    ----------
    bound
        ``"target"``, ``"lower"`` or ``"upper"``.
    **params
        Passed to :class:`VpaRecommender` (e.g. ``time_scale``).

    Examples
    --------
    >>> p = VpaPolicy(time_scale=0.001)
    >>> p.limits(0.0)
    {'cpu': None, 'mem': None}
    >>> for t in range(600):
    ...     _ = p.limits(float(t))
    ...     p.observe(float(t), {"cpu": 0.5, "mem": 3e8})
    >>> lim = p.limits(600.0)
    >>> round(lim["cpu"], 3), lim["mem"] > 3e8
    (0.588, True)
    """

    name = "vpa"

    def __init__(self, bound: str = "target", **params: Any) -> None:
        if bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
        self.bound = bound
        self.params = params
        self._model = VpaRecommender(**params)
        self._last: Limits = {"cpu": None, "mem": None}
        self._other: set[str] = set()  # resources seen in usage that VPA does not manage

    def limits(self, t: float) -> Limits:
        rec = self._model.predict_one()
        lim: Limits = {res: rec[res][self.bound] for res in ("cpu", "mem")}
        for res, v in lim.items():
            if v is not None and not math.isfinite(v):
                lim[res] = None  # an unbounded bound is "no opinion", not an infinite limit
        self._last = lim
        out = dict(lim)
        for res in self._other:
            out[res] = None  # seen, no opinion (e.g. GPU): the caller leaves its limit
        return out

    def observe(self, t: float, usage: Usage) -> None:
        for res in usage:
            if res not in ("cpu", "mem") and res in RESOURCES and res not in self._other:
                self._other.add(res)
        x: dict[str, Any] = {"t": t, "cpu": usage.get("cpu"), "mem": usage.get("mem")}
        x["cpu_limit"] = usage.get("cpu_limit", self._last.get("cpu"))
        x["mem_limit"] = usage.get("mem_limit", self._last.get("mem"))
        x["oom"] = usage.get("oom", 0)
        x["throttled_frac"] = usage.get("throttled_frac")
        x["throttled_cores"] = usage.get("throttled_cores")
        self._model.learn_one(x)

    def explain(self) -> dict:
        out = self._model.explain()
        out["bound"] = self.bound
        out["limits"] = dict(self._last)
        return out

    @property
    def model(self) -> VpaRecommender:
        return self._model

    def to_state(self) -> dict[str, Any]:
        """Compact JSON-able learned state: the recommender's and the last limits."""
        return {"m": self._model.to_state(), "l": dict(self._last), "o": sorted(self._other)}

    @classmethod
    def restore(cls, model: VpaRecommender, last: Limits, bound: str = "target", **params: Any) -> VpaPolicy:
        """A policy built with *bound* and *params* that holds *model* (not copied) and *last*, the
        limits it last returned (what a :class:`~phasewise.models.vpa.fleet.VpaFleet` row holds)."""
        p = cls(bound, **params)
        p._model = model
        p._last = {"cpu": last.get("cpu"), "mem": last.get("mem")}
        return p

    @classmethod
    def from_state(cls, state: Mapping[str, Any], bound: str = "target", **params: Any) -> VpaPolicy:
        """A policy built with *bound* and *params* holding the learned *state*.

        Also reads a bare :meth:`VpaRecommender.to_state` (no last limits).
        """
        if not isinstance(state, Mapping):
            raise VpaStateError(f"VPA policy state must be an object, got {type(state).__name__}")
        p = cls(bound, **params)
        if "m" not in state:  # a recommender's state alone
            p._model = VpaRecommender.from_state(state, **params)
            return p
        p._model = VpaRecommender.from_state(state["m"], **params)
        last = state.get("l") or {}
        if not isinstance(last, Mapping):
            raise VpaStateError(f"VPA policy state: last limits must be an object, got {last!r:.80}")
        p._last = {"cpu": last.get("cpu"), "mem": last.get("mem")}
        p._other = set(state.get("o") or ())
        return p
