"""The live scorecard: what each policy would have allocated against the usage that followed, per container.

:class:`Scorecard` records each container's last samples and each policy's
limit in force in a ring (cheap, vectorised, on the worker's path) and
scores windows when asked, with replay's measures, so a window covering a
container's whole trace scores as replay does. docs/kubernetes.md,
"Recommend mode and the live scorecard".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasewise.models.scoring.measures import Score, common_start, hold_last, score_rows, score_steps

__all__ = ["POLICIES", "RESOURCES", "Scorecard", "ScorecardConfig", "decision_limits"]

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
    """Windows scored (seconds of event time), samples kept per container, the gap rule.

    The worker builds it from ``scorecard_windows`` and ``scorecard_samples``, which hold the
    defaults of the fields they feed (docs/architecture.md, "Defaults").
    """

    windows_s: tuple[float, ...]
    capacity: int
    max_gap_factor: float = 5.0

    def __post_init__(self) -> None:
        if not self.windows_s or any(not (w > 0) for w in self.windows_s):
            raise ValueError(f"windows_s must be positive seconds, got {self.windows_s!r}")
        if self.capacity < 2:
            raise ValueError(f"capacity must be >= 2 samples, got {self.capacity}")
        if not self.max_gap_factor > 1:
            raise ValueError(f"max_gap_factor must be > 1, got {self.max_gap_factor}")


class Scorecard:
    """Per-container rings of (t, usage, limit per policy); scores over sliding windows on demand."""

    def __init__(self, config: ScorecardConfig) -> None:
        self.config = config
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._grow(64)

    def _grow(self, n: int) -> None:
        cap, P, R = self.config.capacity, len(POLICIES), len(RESOURCES)
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

    def _row(self, key: str) -> int:
        r = self._index.get(key)
        if r is None:
            if not self._free:
                self._grow(2 * len(self._t))
            r = self._free.pop()
            self._index[key] = r
        return r

    # ------------------------------------------------------------------ recording (hot path)

    def observe(self, keys: Sequence[str], ts: np.ndarray, used: np.ndarray, in_force: np.ndarray) -> None:
        """Record one sample of each of *keys* (distinct): event times *ts* ``(n,)``, usage
        ``(n, 2)`` (cpu cores, memory bytes) and the limits the samples report ``(n, 2)``
        (``NaN``: unlimited). A sample not newer than its container's last, or without a
        usage, is ignored."""
        if not len(keys):
            return
        get = self._index.get
        rows = [get(k) for k in keys]
        if None in rows:
            rows = [self._row(k) if r is None else r for k, r in zip(keys, rows)]
        rows_a = np.asarray(rows, dtype=np.intp)
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
        self._pos[rows_a] = (p + 1) % self.config.capacity
        self._count[rows_a] = np.minimum(self._count[rows_a] + 1, self.config.capacity)
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

    def clear(self) -> None:
        self.forget(list(self._index))

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[str]:
        return list(self._index)

    # ------------------------------------------------------------------ scoring (on demand)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The container's kept samples in time order: ``t (n,)``, ``used (n, 2)``, ``limits (n, P, 2)``."""
        r = self._index[key]
        n, cap, p = int(self._count[r]), self.config.capacity, int(self._pos[r])
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
        cap = self.config.capacity
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
        windows = []
        for w, per_r in self.scores(key).items():
            sel = t >= t[-1] - w if len(t) else np.zeros(0, dtype=bool)
            for res, per_p in per_r.items():
                for p in POLICIES:
                    s = per_p.get(p)
                    row = {"window_s": w, "resource": res, "policy": p, "samples": int(sel.sum())}
                    if s is None:
                        row["note"] = "no limit in this window" if int(sel.sum()) > 1 else "fewer than 2 samples"
                    else:
                        row.update(score_fields(s))
                    windows.append(row)
        return {"container": key, "now": now, "scorecard": windows}


def score_fields(s: Score) -> dict[str, Any]:
    """A score's numbers as JSON: ``alloc_over_used``, ``fulfilment`` and the parts behind them."""
    return {"alloc_over_used": _f(s.alloc_over_used), "fulfilment": _f(s.fulfilment), "alloc": _f(s.alloc),
            "used": _f(s.used), "fulfilled": s.fulfilled, "steps": s.steps}


def _f(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) or math.isinf(v) else round(v, 6)
