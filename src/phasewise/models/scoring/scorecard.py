"""The live scorecard: what each policy would have allocated against the usage that followed, per container.

:class:`Scorecard` keeps a fixed-size summary per container (time buckets of
the sums the scores add up, ~1 kB) on the worker's path, vectorised, and
scores sliding windows when asked with replay's rules, within the bounds
tested against :class:`ExactScorecard`, which keeps each container's last
samples in a ring and scores them exactly (a window covering a container's
whole trace scores as replay does). docs/worker.md, "The live scorecard".
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasewise.models.scoring.measures import Score, common_start, hold_last, score_rows, score_steps

__all__ = ["POLICIES", "RESOURCES", "ExactScorecard", "Scorecard", "ScorecardConfig", "decision_limits",
           "make_scorecard"]

#: ``limit``: the limit in force (what the samples report); then the policies scored against it
POLICIES = ("limit", "vpa", "phase")
#: the resources scored (the worker's limited resources), with the sample field of each
RESOURCES = ("cpu", "mem")
_P = {p: i for i, p in enumerate(POLICIES)}


def decision_limits(cpu: float | None, mem: float | None, details: Mapping[str, Any] | None) -> dict[str, float]:
    """The limits a decision sets, per resource: the policy's own (``details["limits"]``) where given,
    else the decision's (rounded) field; a resource the decision leaves alone is absent.

    >>> decision_limits(0.6, None, {"limits": {"cpu": 0.575}})
    {'cpu': 0.575}
    >>> decision_limits(None, 2e9, {})
    {'mem': 2000000000.0}
    """
    raw = (details or {}).get("limits") or {}
    out: dict[str, float] = {}
    for r, field_ in (("cpu", cpu), ("mem", mem)):
        if field_ is None:
            continue
        v = raw.get(r)
        out[r] = float(field_ if v is None else v)
    return out


@dataclass(frozen=True)
class ScorecardConfig:
    """Windows scored (seconds of event time), the summary's time buckets per window, or raw samples kept
    per container for exact scoring (``samples`` > 0: :class:`ExactScorecard`), the gap rule.

    The worker builds it from ``scorecard_windows``, ``scorecard_buckets`` and ``scorecard_samples``,
    which hold the defaults of the fields they feed (docs/architecture.md, "Defaults").
    """

    windows_s: tuple[float, ...]
    buckets: int
    samples: int
    max_gap_factor: float = 5.0

    def __post_init__(self) -> None:
        if not self.windows_s or any(not (w > 0) for w in self.windows_s):
            raise ValueError(f"windows_s must be positive seconds, got {self.windows_s!r}")
        if self.samples and self.samples < 2:
            raise ValueError(f"samples must be 0 (the summary) or >= 2, got {self.samples}")
        if not self.samples and self.buckets < 1:
            raise ValueError(f"buckets must be >= 1 for the summary, got {self.buckets}")
        if not self.max_gap_factor > 1:
            raise ValueError(f"max_gap_factor must be > 1, got {self.max_gap_factor}")


def make_scorecard(config: ScorecardConfig) -> Scorecard | ExactScorecard:
    """The fixed-size :class:`Scorecard`, or :class:`ExactScorecard` where ``config.samples`` > 0."""
    return ExactScorecard(config) if config.samples else Scorecard(config)


class _Containers(abc.ABC):
    """The container keys of a scorecard (its ``_index``: key -> row), their rows (``_free``: rows to reuse,
    ``_grow``: more of them) and their removal (``forget``)."""

    _index: dict[str, int]
    _free: list[int]
    #: rows allocated (``_grow`` sets it)
    _capacity: int

    @abc.abstractmethod
    def forget(self, keys: Iterable[str]) -> None:
        """Drop *keys*' rows (their slots are reused)."""

    @abc.abstractmethod
    def _grow(self, n: int) -> None:
        """Hold *n* rows (the new ones free); sets ``_capacity``."""

    def _row(self, key: str) -> int:
        r = self._index.get(key)
        if r is None:
            if not self._free:
                self._grow(2 * self._capacity)
            r = self._free.pop()
            self._index[key] = r
        return r

    def _rows(self, keys: Sequence[str]) -> np.ndarray:
        """The rows of *keys*, new ones allocated."""
        get = self._index.get
        rows = [get(k) for k in keys]
        if None in rows:
            rows = [self._row(k) if r is None else r for k, r in zip(keys, rows)]
        return np.asarray(rows, dtype=np.intp)

    def clear(self) -> None:
        self.forget(list(self._index))

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        return list(self._index)


class ExactScorecard(_Containers):
    """Per-container rings of (t, usage, limit per policy); scores over sliding windows on demand, exactly
    as replay does (``scorecard_samples`` > 0; 72 bytes a sample). The reference :class:`Scorecard` is
    tested against."""

    def __init__(self, config: ScorecardConfig) -> None:
        self.config = config
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._grow(64)

    def _grow(self, n: int) -> None:
        cap, P, R = self.config.samples, len(POLICIES), len(RESOURCES)
        old = getattr(self, "_t", None)
        t = np.full((n, cap), np.nan)
        used = np.full((n, cap, R), np.nan)
        lim = np.full((n, cap, P, R), np.nan)
        held = np.full((n, P, R), np.nan)
        pos = np.zeros(n, dtype=np.intp)
        count = np.zeros(n, dtype=np.intp)
        last = np.full(n, -np.inf)
        if old is not None:
            k = len(old)
            t[:k], used[:k], lim[:k], held[:k] = self._t, self._used, self._lim, self._held
            pos[:k], count[:k], last[:k] = self._pos, self._count, self._last
            self._free += list(range(n - 1, k - 1, -1))
        else:
            self._free = list(range(n - 1, -1, -1))
        self._t, self._used, self._lim, self._held = t, used, lim, held
        self._pos, self._count, self._last = pos, count, last
        self._capacity = n

    # ------------------------------------------------------------------ recording (hot path)

    def observe(self, keys: Sequence[str], ts: np.ndarray, used: np.ndarray, in_force: np.ndarray) -> None:
        """Record one sample of each of *keys* (distinct): event times *ts* ``(n,)``, usage
        ``(n, 2)`` (cpu cores, memory bytes) and the limits the samples report ``(n, 2)``
        (``NaN``: unlimited). A sample not newer than its container's last, or without a
        usage, is ignored."""
        if not len(keys):
            return
        rows_a = self._rows(keys)
        ts = np.broadcast_to(np.asarray(ts, dtype=np.float64), (len(rows_a),))
        newer = (ts > self._last[rows_a]) & ~np.isnan(used).any(axis=1)
        if not newer.all():
            rows_a, ts, used, in_force = rows_a[newer], ts[newer], used[newer], in_force[newer]
        p = self._pos[rows_a]
        self._t[rows_a, p] = ts
        self._used[rows_a, p] = used
        lim = self._held[rows_a]
        lim[:, _P["limit"]] = in_force
        self._lim[rows_a, p] = lim
        self._pos[rows_a] = (p + 1) % self.config.samples
        self._count[rows_a] = np.minimum(self._count[rows_a] + 1, self.config.samples)
        self._last[rows_a] = ts

    def observe_round(self, msgs: Sequence[Any]) -> None:
        """:meth:`observe` every container sample of a worker round of ``HostSamples`` (distinct hosts),
        except those whose per-workload mode is ``off`` (not managed)."""
        keys: list[str] = []
        ts: list[float] = []
        vals: list[tuple] = []
        for m in msgs:
            cs = [c for c in m.containers if c.workload is None or c.workload.mode != "off"]
            h = m.host + "/"
            keys += [h + c.container for c in cs]
            vals += [(c.cpu_cores, c.mem_bytes, c.cpu_limit_cores, c.mem_limit_bytes) for c in cs]
            ts += [m.ts] * len(cs)
        if keys:
            x = np.array(vals, dtype=np.float64)  # None (unlimited) -> NaN
            self.observe(keys, ts[0] if len(msgs) == 1 else np.array(ts), x[:, :2], x[:, 2:])

    def decide(self, key: str, policy: str, limits: Mapping[str, float]) -> None:
        """A decision of *policy* for *key*: its limits hold from the container's next sample on."""
        r = self._row(key)
        p = _P[policy]
        for res, v in limits.items():
            if res in RESOURCES:
                self._held[r, p, RESOURCES.index(res)] = v

    def decide_many(self, decisions: Iterable[Any]) -> None:
        """:meth:`decide` for each ``Decision`` (action ``limit``) of a policy in :data:`POLICIES`."""
        for d in decisions:
            if d.action == "limit" and d.policy in _P:
                lims = decision_limits(d.cpu_limit_cores, d.mem_limit_bytes, d.details)
                if lims:
                    self.decide(f"{d.host}/{d.container}", d.policy, lims)

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            r = self._index.pop(k, None)
            if r is not None:
                self._t[r] = np.nan
                self._held[r] = np.nan
                self._pos[r] = self._count[r] = 0
                self._last[r] = -np.inf
                self._free.append(r)

    # ------------------------------------------------------------------ scoring (on demand)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The container's kept samples in time order: ``t (n,)``, ``used (n, 2)``, ``limits (n, P, 2)``."""
        r = self._index[key]
        n, cap, p = int(self._count[r]), self.config.samples, int(self._pos[r])
        order = (np.arange(p - n, p) % cap) if n else np.arange(0)
        return self._t[r, order], self._used[r, order], self._lim[r, order]

    def scores(self, key: str) -> dict[float, dict[str, dict[str, Score]]]:
        """``{window: {resource: {policy: Score}}}`` (policies without a limit in the window absent)."""
        t, used, lim = self.series(key)
        out: dict[float, dict[str, dict[str, Score]]] = {}
        for w in self.config.windows_s:
            sel = t >= (t[-1] - w) if len(t) else np.zeros(0, dtype=bool)
            out[w] = {res: self._score(t[sel], used[sel, j], lim[sel, :, j]) for j, res in enumerate(RESOURCES)}
        return out

    def _score(self, t: np.ndarray, u: np.ndarray, lim: np.ndarray) -> dict[str, Score]:
        if len(t) < 2:
            return {}
        names = [p for i, p in enumerate(POLICIES) if not np.all(np.isnan(lim[:, i]))]
        if not names:
            return {}
        cols = {p: hold_last(lim[:, _P[p]]) for p in names}
        start = common_start(cols.values())
        g = self.config.max_gap_factor
        return {p: score_steps(t, u, c, start=start, max_gap_factor=g) for p, c in cols.items()}

    def totals(self, chunk: int = 256) -> dict[float, dict[str, dict[str, Score]]]:
        """:meth:`scores` summed over every container (the parts add up, as in replay), vectorised:
        *chunk* containers at a time through :func:`~phasewise.models.scoring.measures.score_rows`."""
        return self.totals_of(self.chunks(chunk))

    def chunks(self, chunk: int = 256) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """:meth:`chrono` copies of every container, *chunk* at a time (what :meth:`totals_of` scores)."""
        rows_all = np.fromiter(self._index.values(), dtype=np.intp, count=len(self._index))
        return [self.chrono(rows_all[c0:c0 + chunk]) for c0 in range(0, len(rows_all), chunk)]

    def totals_of(self, chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
                  ) -> dict[float, dict[str, dict[str, Score]]]:
        """:meth:`totals` of copies taken by :meth:`chunks` (scored without touching the rings)."""
        out: dict[float, dict[str, dict[str, Score]]] = {
            w: {r: {} for r in RESOURCES} for w in self.config.windows_s}
        for c in chunks:
            self._add_totals(out, *c)
        return out

    def chrono(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Copies of *rows*' rings in time order, left-aligned: ``t (N, cap)``, ``used (N, cap, 2)``,
        ``limits (N, cap, P, 2)`` and the sample count ``(N,)`` (slots from it on are ``NaN``)."""
        cap = self.config.samples
        j = np.arange(cap)
        cnt, pos = self._count[rows], self._pos[rows]
        ring = (pos[:, None] - cnt[:, None] + j[None, :]) % cap
        rr = rows[:, None]
        valid = j[None, :] < cnt[:, None]
        t = np.where(valid, self._t[rr, ring], np.nan)
        return t, self._used[rr, ring], np.where(valid[:, :, None, None], self._lim[rr, ring], np.nan), cnt.copy()

    def _add_totals(self, out: dict, t: np.ndarray, used: np.ndarray, lim_all: np.ndarray, cnt: np.ndarray) -> None:
        cap, g = t.shape[1], self.config.max_gap_factor
        j = np.arange(cap)
        newest = t[np.arange(len(t)), np.maximum(cnt - 1, 0)]
        L = _P["limit"]
        for w in self.config.windows_s:
            with np.errstate(invalid="ignore"):
                m = np.count_nonzero(t >= (newest - w)[:, None], axis=1)  # a window is a suffix
            lo = cnt - m
            inw = (j[None, :] >= lo[:, None])[:, :, None]
            for ri, r in enumerate(RESOURCES):
                lim = np.where(inw, lim_all[:, :, :, ri], np.nan)  # (N, cap, P)
                has = ~np.isnan(lim)
                part = has.any(axis=1) & (m >= 2)[:, None]  # the policies compared, per row
                start = np.where(part, has.argmax(axis=1), 0).max(axis=1)  # common_start
                # hold_last: a decided limit holds until the next (never NaN again); the limit in force may
                # read unlimited between limits
                idx = np.where(has[:, :, L], j[None, :], -1)
                np.maximum.accumulate(idx, axis=1, out=idx)
                lim[:, :, L] = np.where(idx >= 0, np.take_along_axis(lim[:, :, L], np.maximum(idx, 0), axis=1),
                                        np.nan)
                rows = part.any(axis=1)
                if not rows.any():
                    continue
                a, us, f, k = score_rows(t[rows], used[rows, :, ri], lim[rows], cnt[rows], start[rows], g,
                                         lo=lo[rows])
                acc = out[w][r]
                any_p = part[rows].any(axis=0)
                for pi, p in enumerate(POLICIES):
                    if any_p[pi]:
                        acc[p] = acc.get(p, Score()) + Score(float(a[:, pi].sum()), float(us[:, pi].sum()),
                                                             int(f[:, pi].sum()), int(k[:, pi].sum()))

    def card(self, key: str) -> dict[str, Any]:
        """What ``phasewise explain`` shows of one container: the limits now and the scorecard."""
        t, used, lim = self.series(key)
        r = self._index[key]
        now: dict[str, Any] = {"t": _f(t[-1]) if len(t) else None}
        for j, res in enumerate(RESOURCES):
            now[res] = {"used": _f(used[-1, j]) if len(t) else None,
                        **{p: _f(self._held[r, i, j]) for i, p in enumerate(POLICIES) if p != "limit"},
                        "limit": _f(lim[-1, _P["limit"], j]) if len(t) else None}
        windows = {}
        for w, per_r in self.scores(key).items():
            windows[w] = (int(np.count_nonzero(t >= t[-1] - w)) if len(t) else 0, per_r)
        return card_of(key, now, windows)


#: summary channels per resource: usage x dt and steps scored, then limit x dt and steps covered per policy
_USED, _STEPS = 0, 1
_ALLOC = slice(2, 2 + len(POLICIES))
_FULL = slice(2 + len(POLICIES), 2 + 2 * len(POLICIES))
_C = 2 + 2 * len(POLICIES)
#: then, after every resource's channels, the bucket's samples and its first sample's time after its start
_NS, _FIRST = len(RESOURCES) * _C, len(RESOURCES) * _C + 1
#: recent sample intervals kept per container, whose median is the step (as the exact window's median)
_DIFFS = 8


class Scorecard(_Containers):
    """A fixed-size summary per container (1020 bytes with the two default windows and 5 buckets);
    the same scores as :class:`ExactScorecard` within the interpolation of one bucket.

    Per window of *w* seconds it keeps ``buckets + 1`` time buckets of ``w / buckets`` seconds, each
    the sums the scores add up (usage x dt, limit x dt and covered steps per policy, steps, samples;
    float32). A sample is added to its bucket when the next one gives its step (the gap rule: a step
    longer than ``max_gap_factor`` x the median of the container's last 8 intervals counts as that
    median); the newest is added when scored, with the median of the window's intervals among those
    8. A window sums its buckets, the oldest (cut by the window's start) in the share of its samples
    in the window (counted from its first at the median interval; pro rata of its sums): the one
    approximation beyond the medians, at most one bucket's worth (docs/worker.md). The common start
    (policies compared from the first sample at which each has a limit) is kept exactly: when a
    policy first has a limit on a resource, that resource's sums restart.
    """

    def __init__(self, config: ScorecardConfig) -> None:
        self.config = config
        ws = np.asarray(config.windows_s, dtype=np.float64)
        #: bucket width per window (inf: one bucket that never turns)
        self._width = ws / config.buckets
        self._slots = config.buckets + 1
        self._wi = np.arange(len(ws))[None, :]
        #: bucket starts are t0 + q x this (an infinite window's one bucket starts at t0)
        self._wfin = np.where(np.isinf(self._width), 0.0, self._width)
        self._t0: float | None = None
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._grow(64)

    @staticmethod
    def nbytes_per_container(windows: int, buckets: int) -> int:
        """Bytes of state per container: the buckets, the newest sample, the limits held, the intervals."""
        P, R = len(POLICIES), len(RESOURCES)
        return 4 * windows * (buckets + 1) * (R * _C + 2) + 8 + 8 * R + 2 * 8 * P * R + 4 * _DIFFS + 4

    def _grow(self, n: int) -> None:
        W, S, P, R = len(self.config.windows_s), self._slots, len(POLICIES), len(RESOURCES)
        new = {"_b": np.zeros((n, W, S, R * _C + 2), np.float32),
               "_last": np.full(n, -np.inf), "_pu": np.full((n, R), np.nan), "_pl": np.full((n, P, R), np.nan),
               "_held": np.full((n, P, R), np.nan), "_diffs": np.full((n, _DIFFS), np.nan, np.float32),
               "_nd": np.zeros(n, np.int32)}
        k = len(self._last) if hasattr(self, "_last") else 0
        for name, a in new.items():
            if k:
                a[:k] = getattr(self, name)
            setattr(self, name, a)
        self._free = list(range(n - 1, k - 1, -1)) + self._free
        self._capacity = n

    # ------------------------------------------------------------------ recording (hot path)

    def observe(self, keys: Sequence[str], ts: np.ndarray, used: np.ndarray, in_force: np.ndarray) -> None:
        """As :meth:`ExactScorecard.observe`: one sample of each of *keys* (distinct)."""
        if not len(keys):
            return
        rows_a = self._rows(keys)
        ts = np.broadcast_to(np.asarray(ts, dtype=np.float64), (len(rows_a),))
        used = np.asarray(used, dtype=np.float64)
        in_force = np.asarray(in_force, dtype=np.float64)
        last = self._last[rows_a]
        newer = (ts > last) & ~np.isnan(used).any(axis=1)
        if not newer.all():
            rows_a, ts, used, in_force, last = rows_a[newer], ts[newer], used[newer], in_force[newer], last[newer]
        if not len(rows_a):
            return
        if self._t0 is None:
            self._t0 = float(ts.min())
        L, S, t0 = _P["limit"], self._slots, self._t0
        q_new = self._buckets(ts)
        prev = last > -np.inf
        if prev.all():
            self._record(rows_a, last, ts, q_new)
        else:
            if prev.any():
                self._record(rows_a[prev], last[prev], ts[prev], q_new[prev])
            fresh = ~prev  # a container's first sample: its buckets start with it
            self._b[rows_a[fresh][:, None], self._wi, q_new[fresh] % S, _FIRST] = \
                ts[fresh][:, None] - (t0 + q_new[fresh] * self._wfin)
        # a policy with its first limit on a resource: that resource's scores start here (the common start)
        held = self._held[rows_a]
        before = ~np.isnan(self._pl[rows_a])
        before[:, L] = ~np.isnan(held[:, L])
        held[:, L] = np.where(np.isnan(in_force), held[:, L], in_force)
        self._held[rows_a, L] = held[:, L]
        start = (~np.isnan(held) & ~before).any(axis=1)  # (n, R)
        if start.any():
            for r in range(len(RESOURCES)):
                rr = rows_a[start[:, r]]
                if len(rr):
                    self._b[rr, :, :, r * _C:(r + 1) * _C] = 0.0
        held[:, L] = in_force
        self._pl[rows_a] = held
        self._pu[rows_a] = used
        self._last[rows_a] = ts

    def _buckets(self, t: np.ndarray) -> np.ndarray:
        """Bucket numbers ``(n, W)`` of event times *t* (0 in an infinite window)."""
        return np.floor((t[:, None] - self._t0) / self._width[None, :]).astype(np.int64)

    def _record(self, rows: np.ndarray, last: np.ndarray, ts: np.ndarray, q_new: np.ndarray) -> None:
        """The previous sample's step is known now: add it to its buckets, then turn them to *ts*'s."""
        S, L, g = self._slots, _P["limit"], self.config.max_gap_factor
        d = ts - last
        nd = self._nd[rows]
        self._diffs[rows, nd % _DIFFS] = d
        self._nd[rows] = nd + 1
        big = d > g * np.fmin.reduce(self._diffs[rows], axis=1)  # a gap only where above the smallest's
        if big.any():
            med = _median(self._diffs[rows[big]])
            d[big] = np.where(d[big] > g * med, med, d[big])
        lim = self._pl[rows]
        lim[:, L] = self._held[rows, L]  # the limit in force held over unlimited samples
        q = self._buckets(last)
        self._b[rows[:, None], self._wi, q % S] += self._step(self._pu[rows], lim, d)[:, None, :]
        adv = q_new - q
        if adv.any():
            top = int(adv.max())
            for k in range(1, min(top - 1, S) + 1):  # buckets passed over (the one just added to, after S)
                ri, wi = np.nonzero(adv > k)
                self._b[rows[ri], wi, (q[ri, wi] + k) % S] = 0.0
            ri, wi = np.nonzero(adv > 0)  # the new bucket: empty but for its first sample's time
            fresh = np.zeros((len(ri), self._b.shape[-1]), np.float32)
            fresh[:, _FIRST] = ts[ri] - (self._t0 + q_new[ri, wi] * self._wfin[wi])
            self._b[rows[ri], wi, q_new[ri, wi] % S] = fresh

    def _step(self, u: np.ndarray, lim: np.ndarray, dt: np.ndarray) -> np.ndarray:
        """Channels ``(n, R x C + 2)`` of one step per row: usage *u* ``(n, R)``, limits ``(n, P, R)``
        (NaN: none), its duration *dt* ``(n,)``; one sample, and 0 for the first sample's time."""
        n, R = u.shape
        out = np.zeros((n, R * _C + 2))
        o = out[:, :R * _C].reshape(n, R, _C)
        o[:, :, _USED] = u * dt[:, None]
        o[:, :, _STEPS] = 1.0
        o[:, :, _ALLOC] = (np.where(np.isnan(lim), 0.0, lim) * dt[:, None, None]).transpose(0, 2, 1)
        o[:, :, _FULL] = (u[:, None, :] <= lim).transpose(0, 2, 1)  # NaN (no limit): False
        out[:, R * _C] = 1.0
        return out

    observe_round = ExactScorecard.observe_round
    decide = ExactScorecard.decide  # (``_held``: the same layout in both)
    decide_many = ExactScorecard.decide_many

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            r = self._index.pop(k, None)
            if r is not None:
                self._b[r] = 0.0
                self._last[r] = -np.inf
                self._pu[r] = self._pl[r] = self._held[r] = np.nan
                self._diffs[r] = np.nan
                self._nd[r] = 0
                self._free.append(r)

    # ------------------------------------------------------------------ scoring (on demand)

    def chunks(self, chunk: int = 4096) -> list[tuple[np.ndarray, ...]]:
        """Copies of every container's summary, *chunk* at a time (what :meth:`totals_of` scores)."""
        rows_all = np.fromiter(self._index.values(), dtype=np.intp, count=len(self._index))
        return [self._copy(rows_all[c0:c0 + chunk]) for c0 in range(0, len(rows_all), chunk)]

    def _copy(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        return (self._b[rows], self._last[rows], self._pu[rows], self._pl[rows], self._held[rows],
                self._diffs[rows], self._nd[rows])

    def windows_of(self, b_all: np.ndarray, last: np.ndarray, pu: np.ndarray, pl: np.ndarray, held: np.ndarray,
                   diffs: np.ndarray, nd: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per window: samples in it ``(N,)``, its channels ``(N, R, C)`` and the policies compared
        ``(N, P, R)`` (the rows of a copy taken by :meth:`chunks`)."""
        S, t0 = self._slots, self._t0 if self._t0 is not None else 0.0
        N, R = pu.shape
        sums = b_all[..., :R * _C].reshape(N, -1, S, R, _C)
        nsamp, first = b_all[..., _NS], b_all[..., _FIRST]
        seen = last > -np.inf
        last = np.where(seen, last, t0)  # a container decided but not yet sampled: nothing to score
        lim = pl.copy()
        lim[:, _P["limit"]] = held[:, _P["limit"]]
        # the kept intervals newest first, and when each began
        j = np.arange(_DIFFS)
        nd = np.asarray(nd)
        ring = np.take_along_axis(diffs.astype(np.float64), (nd[:, None] - 1 - j[None, :]) % _DIFFS, axis=1)
        recent = np.where(j[None, :] < np.minimum(nd, _DIFFS)[:, None], ring, np.nan)
        began = last[:, None] - np.nancumsum(recent, axis=1)
        out = []
        for wi, (w, b) in enumerate(zip(self.config.windows_s, self._width)):
            # the step of the newest sample: the median interval in the window (of the last 8 at most)
            with np.errstate(invalid="ignore"):
                med = _median(np.where(began >= last[:, None] - w, recent, np.nan))
            newest = self._step(pu, lim, np.nan_to_num(med))[:, :R * _C].reshape(N, R, _C)  # none: not scored
            if math.isinf(w):
                wt = np.ones((len(last), S))
            else:
                q_last = _bucket(last, t0, b)
                q = q_last[:, None] - (q_last[:, None] - np.arange(S)[None, :]) % S  # each slot's bucket
                a = (last - w)[:, None]
                wt = (q * b + t0 >= a).astype(np.float64)  # buckets wholly in the window
                # the oldest, cut by the window's start: its samples at or after it, counted from the bucket's
                # first at the median interval (exact for steady sampling), pro rata of its time without one
                oldest = (q * b + t0 < a) & ((q + 1) * b + t0 > a)
                n_s = nsamp[:, wi].astype(np.float64)
                f = q * b + t0 + first[:, wi]
                with np.errstate(invalid="ignore", divide="ignore"):
                    n_in = n_s - np.maximum(np.ceil((a - f) / med[:, None] - 1e-9), 0.0)
                    share = np.where(np.isnan(med)[:, None], ((q + 1) * b + t0 - a) / b,
                                     np.clip(n_in, 0.0, n_s) / np.maximum(n_s, 1.0))
                wt = np.where(oldest, share, wt)
            ch = np.einsum("ns,nsrc->nrc", wt, sums[:, wi].astype(np.float64)) + newest
            n = np.where(seen, np.einsum("ns,ns->n", wt, nsamp[:, wi].astype(np.float64)) + 1.0, 0.0)
            compared = ~np.isnan(lim) & (n >= 1.5)[:, None, None] & seen[:, None, None]
            out.append((n, ch, compared))
        return out

    def totals(self, chunk: int = 4096) -> dict[float, dict[str, dict[str, Score]]]:
        """:meth:`scores` summed over every container (the parts add up, as in replay), vectorised."""
        return self.totals_of(self.chunks(chunk))

    def totals_of(self, chunks: Iterable[tuple[np.ndarray, ...]]) -> dict[float, dict[str, dict[str, Score]]]:
        """:meth:`totals` of copies taken by :meth:`chunks` (scored without touching the summaries)."""
        out: dict[float, dict[str, dict[str, Score]]] = {
            w: {r: {} for r in RESOURCES} for w in self.config.windows_s}
        for c in chunks:
            for w, (_, ch, cmp_) in zip(self.config.windows_s, self.windows_of(*c)):
                for ri, r in enumerate(RESOURCES):
                    for pi, p in enumerate(POLICIES):
                        m = cmp_[:, pi, ri]
                        if m.any():
                            x = ch[m, ri]
                            s = Score(float(x[:, _ALLOC][:, pi].sum()), float(x[:, _USED].sum()),
                                      float(x[:, _FULL][:, pi].sum()), float(x[:, _STEPS].sum()))
                            out[w][r][p] = out[w][r].get(p, Score()) + s
        return out

    def scores(self, key: str) -> dict[float, dict[str, dict[str, Score]]]:
        """``{window: {resource: {policy: Score}}}`` (policies without a limit in the window absent);
        ``fulfilled`` and ``steps`` may be fractional (the oldest bucket's share)."""
        return {w: per_r for w, (_, per_r) in self._scored(key).items()}

    def _scored(self, key: str) -> dict[float, tuple[float, dict[str, dict[str, Score]]]]:
        r = np.array([self._index[key]])
        out = {}
        for w, (n, ch, cmp_) in zip(self.config.windows_s, self.windows_of(*self._copy(r))):
            out[w] = (float(n[0]), {res: {p: Score(float(ch[0, ri, _ALLOC][pi]), float(ch[0, ri, _USED]),
                                                   float(ch[0, ri, _FULL][pi]), float(ch[0, ri, _STEPS]))
                                          for pi, p in enumerate(POLICIES) if cmp_[0, pi, ri]}
                                    for ri, res in enumerate(RESOURCES)})
        return out

    def card(self, key: str) -> dict[str, Any]:
        """What ``phasewise explain`` shows of one container: the limits now and the scorecard."""
        r = self._index[key]
        seen = self._last[r] > -np.inf
        now: dict[str, Any] = {"t": _f(self._last[r]) if seen else None}
        for j, res in enumerate(RESOURCES):
            now[res] = {"used": _f(self._pu[r, j]) if seen else None,
                        **{p: _f(self._held[r, i, j]) for i, p in enumerate(POLICIES) if p != "limit"},
                        "limit": _f(self._pl[r, _P["limit"], j]) if seen else None}
        windows = {w: (round(n), per_r) for w, (n, per_r) in self._scored(key).items()}
        return card_of(key, now, windows)


def _bucket(t: np.ndarray, t0: float, width: float) -> np.ndarray:
    """Bucket numbers of event times *t* (0 for every time where *width* is infinite)."""
    if math.isinf(width):
        return np.zeros(len(t), dtype=np.int64)
    return np.floor((t - t0) / width).astype(np.int64)


def _median(d: np.ndarray) -> np.ndarray:
    """Row medians of the kept intervals ``(n, 8)`` (``NaN``: none yet), as float64."""
    d = np.sort(d.astype(np.float64), axis=1)  # NaN last
    k = np.count_nonzero(~np.isnan(d), axis=1)
    ar = np.arange(len(d))
    lo, hi = np.maximum((k - 1) // 2, 0), np.maximum(k // 2, 0)
    return np.where(k > 0, (d[ar, lo] + d[ar, np.minimum(hi, d.shape[1] - 1)]) / 2, np.nan)


def card_of(key: str, now: dict[str, Any], windows: Mapping[float, tuple[int, Mapping[str, Mapping[str, Score]]]]
            ) -> dict[str, Any]:
    """A card from the limits *now* and ``{window: (samples in it, {resource: {policy: Score}})}``."""
    rows = []
    for w, (n, per_r) in windows.items():
        for res, per_p in per_r.items():
            for p in POLICIES:
                s = per_p.get(p)
                row: dict[str, Any] = {"window_s": w, "resource": res, "policy": p, "samples": n}
                if s is None:
                    row["note"] = "no limit in this window" if n > 1 else "fewer than 2 samples"
                else:
                    row.update(score_fields(s))
                rows.append(row)
    return {"container": key, "now": now, "scorecard": rows}


def score_fields(s: Score) -> dict[str, Any]:
    """A score's numbers as JSON: ``alloc_over_used``, ``fulfilment`` and the parts behind them."""
    return {"alloc_over_used": _f(s.alloc_over_used), "fulfilment": _f(s.fulfilment), "alloc": _f(s.alloc),
            "used": _f(s.used), "fulfilled": round(s.fulfilled), "steps": round(s.steps)}


def _f(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else round(v, 6)
