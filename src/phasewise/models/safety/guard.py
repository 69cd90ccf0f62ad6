"""Safety rules every live limit decision passes, whatever policy proposed it.

A policy proposes limits; :class:`LimitGuard` decides what may be handed to
the actuator (history, throttled, oom, cooldown, step, the workload's own
min/max, peak) and names the rules that bounded each limit. Pure and
vectorised over rows the caller allocates; time is the samples' event time.
The rules: docs/operations.md, "The worker's safety rules".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasewise.models.arrays import grown

__all__ = ["GuardConfig", "GuardOutcome", "LimitGuard", "RESOURCES", "RULES", "bounded_text", "oom_bump"]

#: the resources a guard bounds, in column order
RESOURCES = ("cpu", "mem")
#: the rules, in the order they apply; bit i of an outcome's rule mask is RULES[i]
RULES = ("history", "throttled", "oom", "cooldown", "step", "workload_max", "workload_min", "peak")
#: the CPU-cut rule counts a sample as throttled above this share of the threshold: a host agent's sample
#: and any other reading of the same counters (the kernel's own second, a monitor's) do not cover the same
#: periods, and at 1 s samples one throttled period of ~10 is the whole threshold — a burst just under it in
#: one window is just over it in another (measured: the demo read 1 of 9 periods throttled where the agent's
#: sample stayed at or under 0.1, and a cut went through). Half the threshold covers a window twice as long.
THROTTLE_CUT_SHARE = 0.5
_BIT = {r: 1 << i for i, r in enumerate(RULES)}
_CPU, _MEM = 0, 1
STATE_VERSION = 1
MIB = 2.0**20
_isfinite = math.isfinite
_NAMES: dict[int, tuple[str, ...]] = {}


def _names(mask: int) -> tuple[str, ...]:
    """The rules of a rule mask, in :data:`RULES` order (256 masks at most: kept once each)."""
    got = _NAMES.get(mask)
    if got is None:
        got = _NAMES[mask] = tuple(name for name in RULES if mask & _BIT[name])
    return got


def oom_bump(limit: np.ndarray | float, ratio: float = 1.2, min_bump: float = 100 * MIB) -> np.ndarray | float:
    """VPA's OOM bump of the memory in use at a kill: ``max(ratio x limit, limit + min_bump)``.

    >>> bool(oom_bump(1e9) == max(1.2e9, 1e9 + 100 * 2**20))
    True
    """
    return np.maximum(np.multiply(limit, ratio), np.add(limit, min_bump))


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """The rules' parameters; the worker builds them from its settings (:func:`phasewise.streams.config.guard_config`).

    The fields a setting feeds have no default here: the setting holds it (docs/architecture.md, "Defaults").
    """

    #: event-time seconds of samples before a limit may be lowered (or first set on an unlimited container)
    min_history_s: float
    #: at most one decrease per resource per this many seconds; no memory decrease this long after an OOM kill
    cooldown_s: float
    #: one decrease lowers a limit by at most this fraction of it
    max_decrease: float
    #: memory limits cover the peak working set over this many seconds
    peak_window_s: float
    #: ... plus this many bytes
    mem_margin_bytes: float
    #: share of throttled CFS periods above which the VPA censors a sample; for the CPU-cut rule a
    #: sample counts as throttled above half of it (:data:`THROTTLE_CUT_SHARE`)
    throttle_threshold: float
    #: no CPU decrease when a sample this recent (seconds) was throttled; 0 = only the current one
    #: (the worker uses its cooldown: a throttled container's CPU samples are censored)
    throttle_window_s: float
    #: VPA's OOM bump (``OOMBumpUpRatio``, ``OOMMinBumpUp``)
    oom_bump_ratio: float = 1.2
    oom_min_bump_bytes: float = 100 * MIB

    def __post_init__(self) -> None:
        for name in ("min_history_s", "cooldown_s", "mem_margin_bytes", "throttle_window_s", "oom_min_bump_bytes"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.max_decrease <= 1:
            raise ValueError(f"max_decrease must be in (0, 1], got {self.max_decrease!r}")
        if not (math.isfinite(self.peak_window_s) and self.peak_window_s > 0):
            raise ValueError(f"peak_window_s must be > 0, got {self.peak_window_s!r}")
        if not 0 <= self.throttle_threshold <= 1:
            raise ValueError(f"throttle_threshold must be in [0, 1], got {self.throttle_threshold!r}")
        if not self.oom_bump_ratio >= 1:
            raise ValueError(f"oom_bump_ratio must be >= 1, got {self.oom_bump_ratio!r}")


@dataclass(frozen=True, slots=True)
class GuardOutcome:
    """What :meth:`LimitGuard.bound` allows, rows ``(n, 2)`` in :data:`RESOURCES` order."""

    #: the limit to hand out (NaN: none; meaningful where ``emit``)
    limits: np.ndarray
    #: a decision should carry this resource's limit
    emit: np.ndarray
    #: bit mask of :data:`RULES` that changed or held back the proposal
    rules: np.ndarray
    #: the limit in force the rules compared with (``inf``: unlimited)
    in_force: np.ndarray
    #: the memory floor (peak + margin, OOM bump) per row (NaN: none)
    mem_floor: np.ndarray
    #: the peak working set in the window per row (NaN: no sample yet)
    peak: np.ndarray
    #: per row, the memory limit that answers an OOM kill not answered yet: the OOM bump, capped by
    #: the workload's memory max (NaN: no kill pending)
    oom_target: np.ndarray | None = None

    def rules_of(self, i: int) -> dict[str, list[str]]:
        """The rules that bounded row *i*, per resource (only resources some rule touched)."""
        return {r: list(_names(m)) for r, m in zip(RESOURCES, self.rules[i].tolist()) if m}

    def explain(self, i: int) -> dict[str, Any]:
        """What a decision of row *i* carries (``details["safety"]``): the rules that bounded each
        resource, the limits in force they compared with (None: unlimited), the peak working set in
        the window and the memory floor (None: unknown)."""
        return self.explain_rows([i])[0]

    def explain_rows(self, rows: Any) -> list[dict[str, Any]]:
        """:meth:`explain` of each of *rows* (the arrays are read once for all of them)."""
        idx = np.asarray(rows, dtype=np.intp)
        out = []
        for masks, force, peak, floor in zip(self.rules[idx].tolist(), self.in_force[idx].tolist(),
                                             self.peak[idx].tolist(), self.mem_floor[idx].tolist()):
            out.append({
                "bounded_by": {r: list(_names(m)) for r, m in zip(RESOURCES, masks) if m},
                "in_force": {r: v if _isfinite(v) else None for r, v in zip(RESOURCES, force)},
                "peak_mem_bytes": peak if _isfinite(peak) else None,
                "mem_floor_bytes": floor if _isfinite(floor) else None,
            })
        return out

    def counts(self) -> dict[str, int]:
        """How many (row, resource) cells each rule touched."""
        return {name: int(np.count_nonzero(self.rules & _BIT[name])) for name in RULES}


def bounded_text(safety: Mapping[str, Any]) -> str:
    """The reason suffix naming the rules that bounded a decision (empty when none did).

    >>> bounded_text({"bounded_by": {"cpu": ["history"], "mem": ["step", "peak"]}})
    ' [bounded: cpu by history; mem by step, peak]'
    """
    by = safety.get("bounded_by") or {}
    if not by:
        return ""
    return " [bounded: " + "; ".join(f"{r} by {', '.join(rules)}" for r, rules in by.items()) + "]"


class LimitGuard:
    """Per-container rule state in rows (``add_rows``), and the rules over them."""

    PEAK_BUCKETS = 12
    _ROW = ("_first", "_epoch", "_thr_ts", "_oom_ts", "_oom_floor")

    def __init__(self, config: GuardConfig, capacity: int = 64) -> None:
        self.config = config
        self._bucket_s = self.config.peak_window_s / self.PEAK_BUCKETS
        self.capacity = 0
        self._n = 0
        self._first = self._epoch = self._thr_ts = self._oom_ts = self._oom_floor = np.empty(0)
        self._pending = np.empty(0, dtype=bool)  # an OOM kill no decision has answered yet
        self._peaks = np.empty((0, self.PEAK_BUCKETS))
        self._last = np.empty((0, 2))  # the limits this guard last let out (NaN: none)
        self._last_dec = np.empty((0, 2))  # event time of the last decrease per resource
        #: (row, resource) cells each rule of :data:`RULES` changed or held back, over every :meth:`bound`
        self.totals = np.zeros(len(RULES), dtype=np.int64)
        self._grow(max(1, capacity))

    # ------------------------------------------------------------------ rows
    def _grow(self, capacity: int) -> None:
        old = self.capacity
        if capacity <= old:
            return

        k = capacity - old
        for name in self._ROW:
            setattr(self, name, grown(getattr(self, name), k, np.nan))
        self._pending = grown(self._pending, k, False)
        self._peaks = grown(self._peaks, k, np.nan)
        self._last = grown(self._last, k, np.nan)
        self._last_dec = grown(self._last_dec, k, np.nan)
        self.capacity = capacity

    def add_rows(self, k: int) -> np.ndarray:
        """*k* fresh rows; returns their indices."""
        if self._n + k > self.capacity:
            self._grow(max(self._n + k, 2 * self.capacity))
        rows = np.arange(self._n, self._n + k)
        self._n += k
        self.reset(rows)
        return rows

    def ensure(self, capacity: int) -> None:
        """Room for rows ``0 .. capacity - 1`` (rows the caller allocates itself)."""
        if capacity > self.capacity:
            self._grow(capacity)
        self._n = max(self._n, capacity)

    def reset(self, rows: np.ndarray) -> None:
        """Forget everything about *rows* (a new container in a reused row)."""
        for name in self._ROW:
            getattr(self, name)[rows] = np.nan
        self._pending[rows] = False
        self._peaks[rows] = np.nan
        self._last[rows] = np.nan
        self._last_dec[rows] = np.nan

    # ------------------------------------------------------------------ samples
    def observe(self, rows: np.ndarray, ts: float | np.ndarray, *, mem: np.ndarray, throttled_frac: np.ndarray,
                oom: np.ndarray, mem_limit: np.ndarray) -> None:
        """Learn one sample per row (distinct rows): working set, throttled share, OOM kills, the memory
        limit the sample reports (NaN: none)."""
        c = self.config
        t = np.broadcast_to(np.asarray(ts, dtype=np.float64), rows.shape)
        self._first[rows] = np.fmin(self._first[rows], t)
        thr = throttled_frac > c.throttle_threshold * THROTTLE_CUT_SHARE
        if thr.any():
            r = rows[thr]
            self._thr_ts[r] = np.fmax(self._thr_ts[r], t[thr])
        self._observe_peak(rows, t, mem)
        kill = oom > 0
        if kill.any():
            r = rows[kill]
            # the memory in use at the kill is the limit in force: the one let out, else the sample's
            at = np.where(np.isfinite(self._last[r, _MEM]), self._last[r, _MEM], mem_limit[kill])
            at = np.where(np.isfinite(at), at, self.peak(r))
            bump = oom_bump(at, c.oom_bump_ratio, c.oom_min_bump_bytes)
            self._oom_floor[r] = np.fmax(self._oom_floor[r], bump)
            self._oom_ts[r] = np.fmax(self._oom_ts[r], t[kill])
            self._pending[r] = True

    def _observe_peak(self, rows: np.ndarray, t: np.ndarray, mem: np.ndarray) -> None:
        B = self.PEAK_BUCKETS
        e = np.floor(t / self._bucket_s)
        ok = np.isfinite(mem) & np.isfinite(e)
        if not ok.all():
            rows, e, mem = rows[ok], e[ok], mem[ok]
        if not len(rows):
            return
        old = self._epoch[rows]
        ahead = ~(e <= old)  # a later bucket (or the first sample): clear the buckets passed over
        if ahead.any():
            r, eo, en = rows[ahead], old[ahead], e[ahead]
            gap = np.where(np.isfinite(eo), en - eo, B)
            self._peaks[r[gap >= B]] = np.nan
            part = np.flatnonzero(gap < B)
            for d in range(1, B):
                sel = part[gap[part] >= d]
                if not len(sel):
                    break
                self._peaks[r[sel], ((eo[sel] + d) % B).astype(np.intp)] = np.nan
            self._epoch[r] = en
        cur = self._epoch[rows]
        keep = cur - e < B  # samples older than the window are too old to count
        if not keep.all():
            rows, e, mem = rows[keep], e[keep], mem[keep]
        slot = (e % B).astype(np.intp)
        self._peaks[rows, slot] = np.fmax(self._peaks[rows, slot], mem)

    def peak(self, rows: np.ndarray) -> np.ndarray:
        """The peak working set of each row over the window (NaN: no sample)."""
        p = self._peaks[rows]
        has = ~np.isnan(p).all(axis=1)
        out = np.full(len(rows), np.nan)
        if has.any():
            out[has] = np.nanmax(p[has], axis=1)
        return out

    def pending(self, rows: np.ndarray) -> np.ndarray:
        """Rows with an OOM kill that no decision answered yet (decide for them now)."""
        return self._pending[rows]

    def last_limits(self, rows: np.ndarray) -> np.ndarray:
        """``(n, 2)`` limits this guard last let out (NaN: none yet)."""
        return self._last[rows]

    # ------------------------------------------------------------------ the rules
    def bound(self, rows: np.ndarray, ts: float | np.ndarray, proposed: np.ndarray,
              in_force: np.ndarray, *, lo: np.ndarray | None = None, hi: np.ndarray | None = None,
              known: np.ndarray | None = None) -> GuardOutcome:
        """The rules over a policy's *proposed* limits ``(n, 2)`` (NaN: nothing proposed) for containers
        whose limits in force are *in_force* ``(n, 2)`` (NaN: unlimited). *lo* / *hi* ``(n, 2)``: the
        workloads' own minimum and maximum limits (NaN or ``None``: none). *known* ``(n,)``: rows whose
        proposal rests on earlier runs of the same job (a prior): the history rule counts those runs as
        history (every other rule holds). Reads the state only."""
        c = self.config
        n = len(rows)
        t = np.broadcast_to(np.asarray(ts, dtype=np.float64), (n,))
        L = np.where(np.isnan(in_force), np.inf, in_force)
        p = np.array(proposed, dtype=np.float64, copy=True)
        rules = np.zeros((n, 2), dtype=np.int64)

        peak = self.peak(rows)
        floor = peak + c.mem_margin_bytes
        oom_recent = t - self._oom_ts[rows] < c.cooldown_s
        oom_floor = np.where(oom_recent | self._pending[rows], self._oom_floor[rows], np.nan)
        if hi is not None:  # the workload's memory max caps the OOM bump (never the peak floor)
            oom_floor = np.fmin(oom_floor, np.where(np.isnan(oom_floor), np.nan, hi[:, _MEM]))
        mem_floor = np.fmax(floor, oom_floor)
        # nothing proposed for memory but the limit in force is under the floor (an OOM kill, or the
        # working set pressing on the limit): propose the floor
        under = np.isfinite(mem_floor) & (L[:, _MEM] < mem_floor) & np.isnan(p[:, _MEM])
        p[:, _MEM] = np.where(under, mem_floor, p[:, _MEM])

        down = p < L  # NaN proposals compare False
        young = ~(t - self._first[rows] >= c.min_history_s)
        if known is not None:
            young &= ~known
        hold = np.zeros((n, 2), dtype=bool)

        def block(mask: np.ndarray, rule: str) -> None:
            m = mask & ~hold
            rules[m] |= _BIT[rule]
            hold[m] = True

        block(down & young[:, None], "history")
        throttled = np.zeros((n, 2), dtype=bool)
        throttled[:, _CPU] = t - self._thr_ts[rows] <= c.throttle_window_s
        block(down & throttled, "throttled")
        oom_hold = np.zeros((n, 2), dtype=bool)
        oom_hold[:, _MEM] = oom_recent
        block(down & oom_hold, "oom")
        block(down & (t[:, None] - self._last_dec[rows] < c.cooldown_s), "cooldown")
        out = np.where(hold, L, p)

        with np.errstate(invalid="ignore"):  # inf x 0 for an unlimited resource: masked below
            least = L * (1.0 - c.max_decrease)
        stepped = down & ~hold & np.isfinite(L) & (out < least)  # from unlimited: no step bound
        out = np.where(stepped, least, out)
        rules[stepped] |= _BIT["step"]
        if hi is not None or lo is not None:  # the workload's own bounds, on what is let out
            free = ~hold & np.isfinite(out)
            if hi is not None:
                over = free & (out > hi)  # NaN (no max) compares False
                out = np.where(over, hi, out)
                rules[over] |= _BIT["workload_max"]
            if lo is not None:
                below = free & (out < lo)
                out = np.where(below, lo, out)
                rules[below] |= _BIT["workload_min"]

        mem = out[:, _MEM]
        low = np.isfinite(mem_floor) & np.isfinite(mem) & (mem < mem_floor)
        out[:, _MEM] = np.where(low, mem_floor, mem)
        by_oom = np.isfinite(oom_floor) & ~(oom_floor < floor)
        rules[:, _MEM] |= np.where(low | under, np.where(by_oom, _BIT["oom"], _BIT["peak"]), 0)

        with np.errstate(invalid="ignore"):  # inf - inf where unlimited stays unlimited: not "same"
            same = np.isfinite(L) & (np.abs(out - L) <= 1e-12 * np.abs(L))
        emit = np.isfinite(out) & ~same
        if rules.any():
            for i, bit in enumerate(_BIT.values()):
                self.totals[i] += np.count_nonzero(rules & bit)
        return GuardOutcome(limits=np.where(emit, out, np.nan), emit=emit, rules=rules, in_force=L,
                            mem_floor=mem_floor, peak=peak,
                            oom_target=np.where(self._pending[rows], oom_floor, np.nan))

    def commit(self, rows: np.ndarray, ts: float | np.ndarray, outcome: GuardOutcome,
               limits: np.ndarray | None = None) -> None:
        """Record what was handed out: *limits* ``(n, 2)`` (default: the outcome's; NaN where not emitted),
        e.g. after the caller rounded them."""
        out = outcome.limits if limits is None else limits
        emit = outcome.emit & np.isfinite(out)
        self._answer(rows, outcome, emit[:, _MEM], out[:, _MEM])
        if not emit.any():
            return
        n = len(rows)
        t = np.broadcast_to(np.asarray(ts, dtype=np.float64), (n,))
        last = self._last[rows]
        self._last[rows] = np.where(emit, out, last)
        dec = emit & (out < outcome.in_force)
        if dec.any():
            ld = self._last_dec[rows]
            self._last_dec[rows] = np.where(dec, t[:, None], ld)

    def _answer(self, rows: np.ndarray, outcome: GuardOutcome, emitted: np.ndarray, mem: np.ndarray) -> None:
        """An OOM kill is answered once the memory limit let out, or the one in force when none is, is
        at least its bump (capped by the workload's memory max)."""
        target = outcome.oom_target
        if target is None or not self._pending[rows].any():
            return
        have = np.where(emitted, mem, outcome.in_force[:, _MEM])
        answered = np.isfinite(target) & ~(have < target)
        if answered.any():
            self._pending[rows[answered]] = False

    # ------------------------------------------------------------------ state
    def state_of(self, row: int) -> dict[str, Any]:
        """A small JSON-able dict of *row* (non-finite numbers as None)."""

        def f(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None

        return {
            "v": STATE_VERSION, "bw": self._bucket_s, "f": f(self._first[row]), "e": f(self._epoch[row]),
            "pk": [f(x) for x in self._peaks[row].tolist()], "tt": f(self._thr_ts[row]),
            "ot": f(self._oom_ts[row]), "of": f(self._oom_floor[row]), "op": bool(self._pending[row]),
            "l": [f(x) for x in self._last[row].tolist()], "ld": [f(x) for x in self._last_dec[row].tolist()],
        }

    def load(self, row: int, state: Mapping[str, Any]) -> None:
        """Restore *row* from :meth:`state_of`; ValueError if it is not one (the row is then reset)."""
        try:
            if not isinstance(state, Mapping) or state.get("v") != STATE_VERSION:
                raise ValueError(f"unsupported guard state {str(state)[:80]!r}")

            def num(k: str) -> float:
                v = state.get(k)
                if v is None:
                    return np.nan
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"guard state: {k} must be a number or null")
                return float(v)

            def pair(k: str, size: int) -> np.ndarray:
                v = state.get(k)
                if not isinstance(v, list) or len(v) != size:
                    raise ValueError(f"guard state: {k} must be a list of {size}")
                if any(x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))) for x in v):
                    raise ValueError(f"guard state: {k} holds a non-number")
                return np.array([np.nan if x is None else float(x) for x in v])

            vals = {"_first": num("f"), "_thr_ts": num("tt"), "_oom_ts": num("ot"), "_oom_floor": num("of")}
            last, last_dec = pair("l", 2), pair("ld", 2)
            same_buckets = state.get("bw") == self._bucket_s
            peaks = pair("pk", self.PEAK_BUCKETS) if same_buckets else np.full(self.PEAK_BUCKETS, np.nan)
            epoch = num("e") if same_buckets else np.nan
            pending = bool(state.get("op", False))
        except ValueError:
            self.reset(np.array([row]))
            raise
        for k, v in vals.items():
            getattr(self, k)[row] = v
        self._epoch[row] = epoch
        self._peaks[row] = peaks
        self._last[row] = last
        self._last_dec[row] = last_dec
        self._pending[row] = pending
