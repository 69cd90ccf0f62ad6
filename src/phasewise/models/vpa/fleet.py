"""Many containers' VPA recommenders as arrays: the worker's vectorised VPA, equal to ``VpaPolicy`` bit for bit.

:class:`VpaFleet` holds, for every row (one container), exactly the state of
a :class:`~phasewise.models.vpa.recommender.VpaPolicy` as struct-of-arrays
and runs ``observe`` / ``limits`` / ``predict_one`` for many rows at once,
reading and writing the per-container state format. How the equality is
kept, memory and speed: docs/vpa.md, "VPA as the worker runs it".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from phasewise.models.arrays import all_true, count_true, grown, nan_to_none
from phasewise.models.vpa.histogram_rows import HistogramRows, pow_exact, time_at
from phasewise.models.vpa.recommender import (
    BOUNDS,
    LOWER_CONFIDENCE,
    STATE_VERSION,
    UPPER_CONFIDENCE,
    VpaPolicy,
    VpaRecommender,
    VpaStateError,
)

__all__ = ["FleetRecommendation", "VpaFleet"]

_NAN = math.nan
_COL = {"lower": 0, "target": 1, "upper": 2}



class FleetRecommendation:
    """What :meth:`VpaFleet.predict_many` computes for a batch of rows.

    ``percentiles[res]`` holds the raw lower / target / upper percentiles
    (columns in that order, ``0.0`` when empty), ``nonempty[res]`` whether
    *res* has samples, ``confidence`` the history behind the bounds.
    :meth:`estimate` composes VPA's estimators on demand (``NaN``: no sample
    of *res* yet, the reference's ``None``; ``inf``: an unbounded upper bound).
    """

    __slots__ = ("_fleet", "confidence", "nonempty", "percentiles", "rows")

    def __init__(self, fleet: VpaFleet, rows: np.ndarray, percentiles: dict[str, np.ndarray],
                 nonempty: dict[str, np.ndarray], confidence: np.ndarray) -> None:
        self._fleet = fleet
        self.rows = rows
        self.percentiles = percentiles
        self.nonempty = nonempty
        self.confidence = confidence

    def factors(self, bound: str, idx: np.ndarray | None = None) -> np.ndarray | None:
        """The confidence multipliers of *bound* (``None`` for the target), shared by both resources."""
        if bound == "target":
            return None
        conf = self.confidence if idx is None else self.confidence[idx]
        mult, exp = LOWER_CONFIDENCE if bound == "lower" else UPPER_CONFIDENCE
        f = np.full(conf.shape, 0.0 if exp < 0 else math.inf)  # no history: 0 or inf
        pos = conf > 0
        if count_true(pos):
            f[pos] = pow_exact(lambda c: (1.0 + mult / c) ** exp, conf[pos])
        return f

    def estimate(self, res: str, bound: str, idx: np.ndarray | None = None,
                 factors: np.ndarray | None = None) -> np.ndarray:
        """``VpaRecommender.estimate(res, bound)`` of the rows (or of the rows at positions *idx*).

        *factors*: :meth:`factors` of *bound* for the same rows, to reuse.
        """
        p = self._fleet._proto
        v = self.percentiles[res][:, _COL[bound]]
        ne = self.nonempty[res]
        if idx is not None:
            v, ne = v[idx], ne[idx]
        v = v + v * p.safety_margin
        if bound != "target":
            f = self.factors(bound, idx) if factors is None else factors
            # upper with no history and nothing measured: 0, not 0 * inf
            v = np.multiply(v, f, out=np.zeros(v.shape), where=v != 0)
        v = np.maximum(p.min_cpu_cores if res == "cpu" else p.min_mem_bytes, v)
        v[~ne] = _NAN
        return v

    @property
    def estimates(self) -> dict[str, dict[str, np.ndarray]]:
        """Every estimate: ``{res: {bound: array}}`` (``predict_one``'s layout)."""
        return {res: {b: self.estimate(res, b) for b in BOUNDS} for res in ("cpu", "mem")}


_ROW_FLOATS = ("first_t", "last_t", "last_cpu_t", "last_mem_t", "window_end", "mem_peak", "oom_peak",
               "last_cpu", "last_mem")
_ROW_INTS = ("n", "n_oom", "n_throttled", "n_mem")
_NAN_INIT = {"first_t", "last_t", "last_cpu_t", "last_mem_t", "window_end", "last_cpu", "last_mem"}


class VpaFleet:
    """VPA recommenders and their :class:`VpaPolicy` limits for many containers at once.

    Parameters
    ----------
    bound
        The bound :meth:`limits_many` returns: ``"target"``, ``"lower"`` or ``"upper"``.
    capacity
        Rows to allocate up front (the arrays grow by doubling).
    **params
        :class:`VpaRecommender` constructor arguments (e.g. ``time_scale``).

    Rows come from :meth:`add_rows` (fresh state); :meth:`observe_many`
    equals ``VpaPolicy.observe`` on each row, :meth:`limits_many`
    ``VpaPolicy.limits`` and :meth:`predict_many` ``VpaRecommender.predict_one``.

    Examples
    --------
    >>> import numpy as np
    >>> f = VpaFleet(time_scale=0.001)
    >>> rows = f.add_rows(3)
    >>> for t in range(100):
    ...     f.observe_many(float(t), rows, cpu=np.array([0.2, 1.0, 3.0]), mem=np.full(3, 4e8),
    ...                    cpu_limit=np.array([1.0, np.nan, 2.0]), throttled_frac=np.array([0.0, 0.0, 0.5]))
    >>> cpu, mem = f.limits_many(rows)
    >>> [round(float(v), 3) for v in cpu]          # the throttled one records 2 * 1.5 = 3 cores
    [0.248, 1.169, 3.481]
    >>> f.explain(2)["throttled_samples"], f.recommender(0).samples
    (100, 100)
    """

    def __init__(self, bound: str = "target", capacity: int = 64, **params: Any) -> None:
        if bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {bound!r}")
        proto = VpaRecommender(**params)  # validates the parameters, holds the defaults
        self.bound = bound
        self.capacity = max(1, int(capacity))
        self.params = dict(params)
        self._proto = proto
        self._ps = (proto.lower_percentile, proto.target_percentile, proto.upper_percentile)
        self._ps_arr = np.array(self._ps)
        self._mem_interval = proto._mem_interval
        self._conf_interval = proto.confidence_interval_s * proto.time_scale
        self._cpu = HistogramRows(proto._cpu.buckets, proto._cpu.half_life, self.capacity, 3)
        self._mem = HistogramRows(proto._mem.buckets, proto._mem.half_life, self.capacity, 3)
        self._rows = 0
        for name in _ROW_FLOATS:
            setattr(self, "_" + name, np.full(self.capacity, _NAN if name in _NAN_INIT else 0.0))
        for name in _ROW_INTS:
            setattr(self, "_" + name, np.zeros(self.capacity, dtype=np.int64))
        self._mark = np.full(self.capacity, -1, dtype=np.intp)  # scratch for the distinct-rows check

    # ------------------------------------------------------------------ rows

    def __len__(self) -> int:
        return self._rows

    def add_rows(self, k: int) -> np.ndarray:
        """Allocate *k* rows with fresh (empty) state; returns their indices."""
        start = self._rows
        end = start + k
        if end > self.capacity:
            cap = self.capacity
            while cap < end:
                cap *= 2
            self._grow(cap)
        self._rows = end
        rows = np.arange(start, end)
        self.reset_rows(rows)
        return rows

    def _grow(self, capacity: int) -> None:
        n = self.capacity
        self._cpu.grow(capacity)
        self._mem.grow(capacity)
        for name in _ROW_FLOATS:
            a = getattr(self, "_" + name)
            setattr(self, "_" + name, grown(a, capacity - n, _NAN if name in _NAN_INIT else 0.0))
        for name in _ROW_INTS:
            a = getattr(self, "_" + name)
            setattr(self, "_" + name, grown(a, capacity - n))
        self._mark = np.full(capacity, -1, dtype=np.intp)
        self.capacity = capacity

    def reset_rows(self, rows: np.ndarray) -> None:
        """Give *rows* fresh (empty) state."""
        self._cpu.reset(rows)
        self._mem.reset(rows)
        for name in _ROW_FLOATS:
            getattr(self, "_" + name)[rows] = _NAN if name in _NAN_INIT else 0.0
        for name in _ROW_INTS:
            getattr(self, "_" + name)[rows] = 0

    def clear(self) -> None:
        """Forget every row."""
        self._rows = 0

    def last_sample_time(self, rows: np.ndarray) -> np.ndarray:
        """Event time of each row's newest CPU sample (``NaN``: none yet)."""
        return self._last_t[np.asarray(rows, dtype=np.intp)].copy()

    def bytes_per_row(self) -> int:
        """Memory one row's state takes (histograms, cached percentiles, scalars)."""
        per_hist = 8 * (self._cpu.nb + 2 + 2 + 3) + 2  # weights; total, ref; lo, hi; percentiles; 2 flags
        return 2 * per_hist + 8 * (len(_ROW_FLOATS) + len(_ROW_INTS) + 1)

    # ------------------------------------------------------------------ learning

    def observe_many(
        self,
        t: float | np.ndarray,
        rows: np.ndarray,
        cpu: np.ndarray,
        mem: np.ndarray,
        *,
        cpu_limit: np.ndarray | None = None,
        mem_limit: np.ndarray | None = None,
        oom: np.ndarray | None = None,
        throttled_frac: np.ndarray | None = None,
        throttled_cores: np.ndarray | None = None,
        check_rows: bool = True,
    ) -> None:
        """``VpaPolicy.observe(t, usage)`` for every row (*rows* must be distinct).

        *t* is one time for all rows or one per row. ``NaN`` marks a missing
        value. A missing ``cpu_limit`` / ``mem_limit`` is replaced by the
        row's last limit (as ``VpaPolicy.observe`` does when the usage has no
        such key); ``oom`` counts OOM kills (any non-zero value records one,
        as the reference does). Invalid input raises ``ValueError`` before
        any row learns anything; ``check_rows=False`` skips checking that
        *rows* are allocated and distinct (for callers that guarantee it).
        """
        rows = np.asarray(rows, dtype=np.intp)
        k = rows.size
        if k == 0:
            return
        if isinstance(t, (float, int, np.floating, np.integer)):
            t = float(t)
            if not math.isfinite(t):
                raise ValueError(f"sample time must be finite, got {t!r}")
        else:
            t = np.asarray(t, dtype=np.float64)
            if t.shape != (k,):
                raise ValueError(f"t must be one time or one per row ({k}), got shape {t.shape}")
            if not np.isfinite(t).all():
                raise ValueError(f"sample time must be finite, got {float(t[~np.isfinite(t)][0])!r}")
        cpu = np.asarray(cpu, dtype=np.float64)
        mem = np.asarray(mem, dtype=np.float64)
        nan = {}
        for name, v in (("cpu", cpu), ("mem", mem)):
            if v.shape != (k,):
                raise ValueError(f"{name} must have one value per row ({k}), got shape {v.shape}")
            nan[name] = False
            if count_true(v >= 0) != k or count_true(v == math.inf):  # NaN (missing) lands here too
                bad = (v < 0) | (v == math.inf)
                if count_true(bad):
                    raise ValueError(f"{name} must be a finite number >= 0, got {float(v[bad][0])!r}")
                nan[name] = bool(count_true(np.isnan(v)))
        if check_rows:
            if rows.min() < 0 or rows.max() >= self._rows:
                raise IndexError(f"rows must be in [0, {self._rows - 1}]")
            if k > 1:
                mark = self._mark
                order = np.arange(k)
                mark[rows] = order
                if not (mark[rows] == order).all():
                    raise ValueError("rows must be distinct (one sample per row per call)")
        if cpu_limit is None:
            cpu_limit = self._last_cpu[rows]
        else:
            cpu_limit = np.asarray(cpu_limit, dtype=np.float64)
            miss = np.isnan(cpu_limit)
            if count_true(miss):  # not reported: the policy's last limit stands in
                cpu_limit = np.where(miss, self._last_cpu[rows], cpu_limit)
        self._add_cpu(rows, t, cpu, nan["cpu"], cpu_limit, throttled_frac, throttled_cores)
        if not nan["mem"]:
            self._add_memory(rows, t, mem, is_oom=False)
        else:
            has = ~np.isnan(mem)
            if count_true(has):
                self._add_memory(rows[has], time_at(t, has), mem[has], is_oom=False)
        if oom is not None:
            oom = np.asarray(oom, dtype=np.float64)
            if count_true(oom):  # NaN counts here, not below
                hit = (oom != 0) & (oom == oom)
                if count_true(hit):
                    hr = rows[hit]
                    ml = self._last_mem[hr] if mem_limit is None else np.asarray(mem_limit, dtype=np.float64)[hit]
                    ml = np.where(np.isnan(ml), self._last_mem[hr], ml)
                    self._record_oom(hr, time_at(t, hit), ml)

    def _add_cpu(self, rows: np.ndarray, t: float | np.ndarray, cpu: np.ndarray, cpu_nan: bool, limit: np.ndarray,
                 throttled: np.ndarray | None, throttled_cores: np.ndarray | None) -> None:
        skip = t <= self._last_cpu_t[rows]  # duplicate / out of order: discarded (VPA does)
        if cpu_nan:
            skip |= np.isnan(cpu)
        if count_true(skip):
            ok = ~skip
            if not count_true(ok):
                return
            rows, t, cpu, limit = rows[ok], time_at(t, ok), cpu[ok], limit[ok]
            if throttled is not None:
                throttled = np.asarray(throttled, dtype=np.float64)[ok]
            if throttled_cores is not None:
                throttled_cores = np.asarray(throttled_cores, dtype=np.float64)[ok]
        p = self._proto
        value = cpu
        if throttled is not None:
            over = np.asarray(throttled, dtype=np.float64) > p.throttle_threshold  # NaN: not reported
            if count_true(over):
                thr = over & (np.abs(limit) > 0)  # the reference's `if limit`: set (not NaN) and non-zero
                if count_true(thr):
                    value = np.where(thr, np.maximum(cpu, limit * (1.0 + p.throttle_bump)), cpu)
                    if throttled_cores is not None:
                        tc = np.asarray(throttled_cores, dtype=np.float64)
                        tc_on = thr & (np.abs(tc) > 0)
                        if count_true(tc_on):
                            value = np.where(tc_on, np.maximum(value, cpu + tc), value)
                    self._n_throttled[rows[thr]] += 1
        self._cpu.add(rows, value, p.min_sample_weight, t)
        self._last_cpu_t[rows] = t
        self._last_t[rows] = np.fmax(self._last_t[rows], t)  # NaN (no sample yet) loses
        self._first_t[rows] = np.fmin(self._first_t[rows], t)
        self._n[rows] += 1

    def _add_memory(self, rows: np.ndarray, t: float | np.ndarray, usage: np.ndarray, is_oom: bool) -> None:
        if not is_oom:
            old = t < self._last_mem_t[rows]  # outdated samples are discarded
            if count_true(old):
                ok = ~old
                rows, t, usage = rows[ok], time_at(t, ok), usage[ok]
                if rows.size == 0:
                    return
        self._last_mem_t[rows] = t
        we = self._window_end[rows]
        inside = t < we  # NaN (no window yet): not inside
        peak = self._mem_peak[rows]
        oom_peak = self._oom_peak[rows]
        prev = np.maximum(peak, oom_peak)
        replace = usage > prev
        if all_true(inside):
            if not count_true(replace):
                return  # the common case: not above this interval's peak
            move = None
            replace &= prev != 0
        else:
            replace &= inside & (prev != 0)
            move = ~inside
            unset = np.isnan(we)
            if count_true(unset):
                we = np.where(unset, t, we)
            step = self._mem_interval
            wm = we[move]
            we[move] = wm + (np.floor((time_at(t, move) - wm) / step) * step + step)  # the interval holding t
            peak[move] = 0.0
            oom_peak[move] = 0.0
            self._n_mem[rows[move]] += 1
            self._window_end[rows] = we
        replacing = count_true(replace)
        if replacing:  # a higher peak in the same interval: it replaces the old one
            self._mem.replace(rows[replace], prev[replace], usage[replace], 1.0, we[replace])
            (oom_peak if is_oom else peak)[replace] = usage[replace]
        if move is not None:
            self._mem.add(rows[move], usage[move], 1.0, we[move])
            (oom_peak if is_oom else peak)[move] = usage[move]
        elif not replacing:
            return
        self._mem_peak[rows] = peak
        self._oom_peak[rows] = oom_peak

    def _record_oom(self, rows: np.ndarray, t: float | np.ndarray, mem_limit: np.ndarray) -> None:
        # kept unless an interval before the last memory sample (NaN: never a memory sample)
        ok = ~(t < self._last_mem_t[rows] - self._mem_interval)
        if not all_true(ok):
            rows, t, mem_limit = rows[ok], time_at(t, ok), mem_limit[ok]
            if rows.size == 0:
                return
        p = self._proto
        limit = np.where(np.isnan(mem_limit), 0.0, mem_limit)  # `mem_limit or 0.0`
        used = np.maximum(self._mem_peak[rows], limit)
        needed = np.maximum(used + p.oom_min_bump_bytes, used * p.oom_bump_ratio)
        self._n_oom[rows] += 1
        self._add_memory(rows, t, needed, is_oom=True)

    # ------------------------------------------------------------------ prediction

    def predict_many(self, rows: np.ndarray) -> FleetRecommendation:
        """Percentiles and confidence of every row: ``VpaRecommender.predict_one`` via
        :meth:`FleetRecommendation.estimate` / :attr:`FleetRecommendation.estimates`."""
        rows = np.asarray(rows, dtype=np.intp)
        n = self._n[rows]
        ci = self._conf_interval
        life = (self._last_t[rows] - self._first_t[rows]) / ci  # NaN before any sample: quiet
        conf = np.where(n > 0, np.minimum(life, n / (ci / 60.0)), 0.0)
        pc_cpu, ne_cpu = self._cpu.percentiles(rows, self._ps_arr)
        pc_mem, ne_mem = self._mem.percentiles(rows, self._ps_arr)
        return FleetRecommendation(self, rows, {"cpu": pc_cpu, "mem": pc_mem}, {"cpu": ne_cpu, "mem": ne_mem},
                                   conf)

    def limits_many(self, rows: np.ndarray, rec: FleetRecommendation | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """``VpaPolicy.limits`` for every row: ``(cpu, mem)`` arrays, ``NaN`` = no limit.

        Like the policy, it remembers them as the rows' last limits (what
        later samples that report no limit count as the limit in force: the
        throttling bump's and the OOM peak's base). *rec*:
        a :meth:`predict_many` result for these *rows* to reuse.
        """
        rows = np.asarray(rows, dtype=np.intp)
        if rec is None:
            rec = self.predict_many(rows)
        out = []
        for res, last in (("cpu", self._last_cpu), ("mem", self._last_mem)):
            v = rec.estimate(res, self.bound)
            if self.bound == "upper":
                v = np.where(np.isinf(v), _NAN, v)  # an unbounded bound is "no opinion"
            last[rows] = v
            out.append(v)
        return out[0], out[1]

    def explain(self, row: int, rec: FleetRecommendation | None = None, i: int = 0) -> dict[str, Any]:
        """``VpaRecommender.explain()`` of one row (*rec*, *i*: a batch result and the row's place in it)."""
        if rec is None:
            rec, i = self.predict_many(np.array([row])), 0
        n = int(self._n[row])
        names = [f"p{round(q * 100):g}" for q in self._ps]
        return {
            "cpu_percentiles": dict(zip(names, rec.percentiles["cpu"][i].tolist())),
            "mem_peak_percentiles": dict(zip(names, rec.percentiles["mem"][i].tolist())),
            "cpu_samples": n,
            "mem_peaks": int(self._n_mem[row]),
            "oom_events": int(self._n_oom[row]),
            "throttled_samples": int(self._n_throttled[row]),
            "history_s": 0.0 if n == 0 else float(self._last_t[row] - self._first_t[row]),
            "confidence": float(rec.confidence[i]),
            "safety_margin": self._proto.safety_margin,
        }

    def last_limits(self, row: int) -> dict[str, float | None]:
        """The row's last limits (``VpaPolicy._last``)."""
        return {"cpu": nan_to_none(self._last_cpu[row]), "mem": nan_to_none(self._last_mem[row])}

    def samples(self, row: int) -> int:
        """CPU samples the row has learned."""
        return int(self._n[row])

    @property
    def target_percentile(self) -> float:
        """The percentile of the usage histograms every row's target is (``VpaRecommender``'s)."""
        return self._proto.target_percentile

    @property
    def safety_margin(self) -> float:
        """The fraction every row's estimates add on top of the percentiles (``VpaRecommender``'s)."""
        return self._proto.safety_margin

    # ------------------------------------------------------------------ state

    def recommender_state(self, row: int) -> dict[str, Any]:
        """Exactly ``VpaRecommender.to_state()`` of the row."""
        return {
            "v": STATE_VERSION,
            "c": self._cpu.to_state(row),
            "m": self._mem.to_state(row),
            "f": nan_to_none(self._first_t[row]), "l": nan_to_none(self._last_t[row]), "n": int(self._n[row]),
            "lc": nan_to_none(self._last_cpu_t[row]), "lm": nan_to_none(self._last_mem_t[row]),
            "we": nan_to_none(self._window_end[row]),
            "mp": nan_to_none(self._mem_peak[row]), "op": nan_to_none(self._oom_peak[row]),
            "no": int(self._n_oom[row]), "nt": int(self._n_throttled[row]), "nm": int(self._n_mem[row]),
        }

    def load_recommender_state(self, row: int, state: Mapping[str, Any],
                               last: Mapping[str, Any] | None = None) -> None:
        """Load a ``VpaRecommender.to_state()`` dict (and the policy's last limits) into *row*.

        Raises :class:`~phasewise.models.vpa.recommender.VpaStateError` on a malformed
        state, leaving the row as it was.
        """
        rec = VpaRecommender.from_state(state, **self.params)
        if last is not None and not isinstance(last, Mapping):
            raise VpaStateError(f"VPA policy state: last limits must be an object, got {last!r:.80}")
        try:
            cpu_last = _float_or_nan((last or {}).get("cpu"))
            mem_last = _float_or_nan((last or {}).get("mem"))
        except (TypeError, ValueError) as e:
            raise VpaStateError(f"VPA policy state: bad last limits {last!r:.80}: {e}") from e
        self.load_recommender(row, rec)
        self._last_cpu[row] = cpu_last
        self._last_mem[row] = mem_last

    def load_recommender(self, row: int, r: VpaRecommender) -> None:
        """Copy *r*'s learned state into *row* exactly (the last limits are left as they are)."""
        for h, src in ((self._cpu, r._cpu), (self._mem, r._mem)):
            if src.buckets != h.buckets or src.half_life != h.half_life:
                raise ValueError("the recommender's histograms do not match this fleet's parameters")
            h.load(row, src._w, src._total, src._ref)
        try:
            self._first_t[row] = _float_or_nan(r._first_t)
            self._last_t[row] = _float_or_nan(r._last_t)
            self._last_cpu_t[row] = _float_or_nan(r._last_cpu_t)
            self._last_mem_t[row] = _float_or_nan(r._last_mem_t)
            self._window_end[row] = _float_or_nan(r._window_end)
        except (TypeError, ValueError) as e:
            raise VpaStateError(f"VPA state has a non-numeric time: {e}") from e
        self._mem_peak[row] = r._mem_peak
        self._oom_peak[row] = r._oom_peak
        self._n[row] = r._n
        self._n_oom[row] = r._n_oom
        self._n_throttled[row] = r._n_throttled
        self._n_mem[row] = r._n_mem

    def recommender(self, row: int) -> VpaRecommender:
        """An exact :class:`VpaRecommender` copy of the row (a snapshot, detached from the fleet)."""
        r = VpaRecommender(**self.params)
        for h, dst in ((self._cpu, r._cpu), (self._mem, r._mem)):
            dst._w = h.weights(row)
            dst._total = float(h.total[row])
            dst._ref = nan_to_none(h.ref[row])
        r._first_t, r._last_t = nan_to_none(self._first_t[row]), nan_to_none(self._last_t[row])
        r._last_cpu_t, r._last_mem_t = nan_to_none(self._last_cpu_t[row]), nan_to_none(self._last_mem_t[row])
        r._window_end = nan_to_none(self._window_end[row])
        r._mem_peak, r._oom_peak = float(self._mem_peak[row]), float(self._oom_peak[row])
        r._n, r._n_oom = int(self._n[row]), int(self._n_oom[row])
        r._n_throttled, r._n_mem = int(self._n_throttled[row]), int(self._n_mem[row])
        return r

    def policy(self, row: int) -> VpaPolicy:
        """An exact :class:`VpaPolicy` copy of the row: its recommender and last limits (detached)."""
        return VpaPolicy.restore(self.recommender(row), self.last_limits(row), self.bound, **self.params)

    def __repr__(self) -> str:
        return f"VpaFleet(rows={self._rows}, bound={self.bound!r}, params={self.params!r})"


def _float_or_nan(v: Any) -> float:
    return _NAN if v is None else float(v)
