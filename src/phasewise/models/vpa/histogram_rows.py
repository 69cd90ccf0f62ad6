"""Dense rows of VPA's decaying histograms: the array state under :class:`~phasewise.models.vpa.fleet.VpaFleet`.

:class:`HistogramRows` keeps, per row, exactly what a
:class:`~phasewise.models.vpa.histogram.DecayingHistogram` keeps (one float64
per bucket, the total, the reference time) and updates many rows with the
reference's IEEE operations in its order, so every weight is the reference's
bit for bit (docs/results.md, "VPA as the worker runs it").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from phasewise.models.arrays import all_true, count_true, grown
from phasewise.models.vpa.histogram import MAX_CHECKPOINT_WEIGHT, MAX_DECAY_EXPONENT, ExponentialBuckets

__all__ = ["HistogramRows", "pow_exact", "time_at"]

_NAN = math.nan


def pow_exact(fn: Any, x: np.ndarray) -> np.ndarray:
    """``fn(v)`` (a Python power) for every element, evaluated once per distinct value."""
    if x.size > 1 and not count_true(x != x[0]):
        return np.full(x.shape, fn(float(x[0])))
    if x.size > 8:
        u, inv = np.unique(x, return_inverse=True)
        return np.array([fn(v) for v in u.tolist()])[inv]
    return np.array([fn(v) for v in x.tolist()])


def time_at(t: float | np.ndarray, m: Any) -> float | np.ndarray:
    """*t* at the selection *m* (a scalar time stays a scalar)."""
    return t if isinstance(t, float) else t[m]



class HistogramRows:
    """Dense rows of :class:`~phasewise.models.vpa.histogram.DecayingHistogram` state.

    Besides the reference's state (weights, total, reference time) each row
    keeps its first / last non-empty bucket (``lo`` / ``hi``; ``nb`` / ``-1``
    when empty) and its percentiles as of its last change (``pc``, valid
    where ``fresh``), both pure functions of the weights.
    """

    __slots__ = ("W", "Wf", "buckets", "ends", "eps", "fresh", "half_life", "hi", "last", "lo", "nb", "pc", "ref",
                 "starts", "starts1", "subeps", "top_start", "total")

    def __init__(self, buckets: ExponentialBuckets, half_life: float, capacity: int, nps: int) -> None:
        self.buckets = buckets
        self.half_life = half_life
        self.eps = buckets.epsilon
        self.nb = buckets.num_buckets
        self.last = self.nb - 1
        self.starts = np.array([buckets.start(i) for i in range(self.nb)])
        self.ends = np.array([buckets.end(i) for i in range(self.nb)])
        self.starts1 = self.starts[1:].copy()  # bucket of v = how many of these are <= v
        self.top_start = float(self.starts[self.last - 1])
        self.W = np.zeros((capacity, self.nb))
        self.Wf = self.W.reshape(-1)  # flat view: W[r, b] is Wf[r * nb + b]
        self.total = np.zeros(capacity)
        self.ref = np.full(capacity, _NAN)
        self.lo = np.full(capacity, self.nb, dtype=np.intp)
        self.hi = np.full(capacity, -1, dtype=np.intp)
        self.pc = np.zeros((capacity, nps))
        self.fresh = np.zeros(capacity, dtype=bool)
        self.subeps = np.zeros(capacity, dtype=bool)  # holds a weight in (0, eps): only a loaded state does

    def grow(self, capacity: int) -> None:
        k = capacity - len(self.total)
        self.W = grown(self.W, k)
        self.Wf = self.W.reshape(-1)
        self.total = grown(self.total, k)
        self.ref = grown(self.ref, k, _NAN)
        self.lo = grown(self.lo, k, self.nb)
        self.hi = grown(self.hi, k, -1)
        self.pc = grown(self.pc, k)
        self.fresh = grown(self.fresh, k)
        self.subeps = grown(self.subeps, k)

    def reset(self, rows: np.ndarray) -> None:
        self.W[rows] = 0.0
        self.total[rows] = 0.0
        self.ref[rows] = _NAN
        self.lo[rows] = self.nb
        self.hi[rows] = -1
        self.fresh[rows] = False
        self.subeps[rows] = False

    def rescan(self, rows: np.ndarray) -> None:
        """Recompute ``lo`` / ``hi`` (and the sub-epsilon flag) of *rows* from their weights."""
        W = self.W[rows]
        ne = W >= self.eps
        self.subeps[rows] = ((W > 0) & ~ne).any(axis=1)
        some = ne.any(axis=1)
        self.lo[rows] = np.where(some, ne.argmax(axis=1), self.nb)
        self.hi[rows] = np.where(some, self.last - ne[:, ::-1].argmax(axis=1), -1)
        self.fresh[rows] = False

    # ------------------------------------------------------------ updates

    def find(self, values: np.ndarray) -> np.ndarray:
        """``ExponentialBuckets.find_bucket`` of every value.

        The bucket whose ``[start, next start)`` holds the value, which is what
        the reference's log-and-correct computes, except just below the open
        last bucket, where its clamp may answer the last bucket: those go
        through the reference's own code.
        """
        b = self.starts1.searchsorted(values, side="right")
        if count_true(values >= self.top_start):
            top = b == self.last - 1
            if count_true(top):
                b[top] = [self.buckets.find_bucket(v) for v in values[top].tolist()]
        return b

    def _factor(self, rows: np.ndarray, t: float | np.ndarray) -> np.ndarray | float:
        """``DecayingHistogram._decay_factor`` of each row (fixes / shifts references)."""
        hl = self.half_life
        ref = self.ref[rows]
        new = np.isnan(ref)
        if count_true(new):  # rows without a reference take the one their sample gives
            ref[new] = np.floor(time_at(t, new) / hl + 0.5) * hl
            self.ref[rows[new]] = ref[new]
        x = (t - ref) / hl
        if count_true(x >= MAX_DECAY_EXPONENT - 1):  # maybe past the limit: the reference's own test
            shift = t > ref + hl * MAX_DECAY_EXPONENT
            if count_true(shift):
                for i in np.flatnonzero(shift).tolist():
                    ref[i] = self._shift(int(rows[i]), float(time_at(t, i)))
                x = (t - ref) / hl
        x0 = x[0]
        if not count_true(x != x0):
            return 2.0 ** float(x0)
        return pow_exact(lambda v: 2.0 ** v, x)

    def _shift(self, row: int, t: float) -> float:
        hl = self.half_life
        new_ref = math.floor(t / hl + 0.5) * hl
        old_ref = float(self.ref[row])
        factor = math.ldexp(1.0, math.floor((old_ref - new_ref) / hl + 0.5))
        w = self.W[row]
        w *= factor
        w[w < self.eps] = 0.0
        kept = w[w != 0.0]
        self.total[row] = math.fsum(kept.tolist()) if kept.size else 0.0
        self.ref[row] = new_ref
        self.rescan(np.array([row]))
        return new_ref

    def add(self, rows: np.ndarray, values: np.ndarray, weights: np.ndarray | float,
            t: float | np.ndarray, factored: bool = False) -> None:
        """``DecayingHistogram.add`` on distinct *rows* (*factored*: *weights* are already decayed)."""
        w = weights if factored else weights * self._factor(rows, t)
        b = self.find(values)
        fi = rows * self.nb + b
        nw = self.Wf[fi] + w
        self.Wf[fi] = nw
        self.total[rows] += w
        self.fresh[rows] = False
        if count_true(nw < self.eps):  # weights only grow: the bucket joins the non-empty ones or nothing changes
            ok = nw >= self.eps
            self.subeps[rows[~ok & (nw > 0)]] = True
            rows, b = rows[ok], b[ok]
        self.lo[rows] = np.minimum(self.lo[rows], b)
        self.hi[rows] = np.maximum(self.hi[rows], b)

    def replace(self, rows: np.ndarray, old: np.ndarray, new: np.ndarray, weight: float, t: np.ndarray) -> None:
        """``subtract(old, weight, t)`` then ``add(new, weight, t)`` on distinct *rows*.

        The second decay factor equals the first (a reference shift, if any,
        happened in the first), so it is computed once.
        """
        w = weight * self._factor(rows, t)
        self.subtract(rows, old, w, t, factored=True)
        self.add(rows, new, w, t, factored=True)

    def subtract(self, rows: np.ndarray, values: np.ndarray, weight: float | np.ndarray, t: np.ndarray,
                 factored: bool = False) -> None:
        """``DecayingHistogram.subtract`` on distinct *rows* (*factored*: *weight* is already decayed)."""
        w = weight if factored else weight * self._factor(rows, t)
        b = self.find(values)
        fi = rows * self.nb + b
        have = self.Wf[fi]
        w = np.where(w > have - self.eps, have, w)
        left = have - w
        self.total[rows] -= w
        drop = left < self.eps
        self.Wf[fi] = np.where(drop, 0.0, left)
        self.fresh[rows] = False
        if count_true(drop):  # a bucket emptied: the total's remainder goes, and lo / hi may move
            dr, db = rows[drop], b[drop]
            self.total[dr] -= left[drop]
            lo, hi = self.lo[dr], self.hi[dr]
            only = (lo == db) & (hi == db)  # its one non-empty bucket went
            if count_true(only):
                gone = dr[only]
                self.lo[gone] = self.nb
                self.hi[gone] = -1
                sub = self.subeps[gone]  # else no weight is left at all: the reference's empty dict
                if count_true(sub):
                    sub[sub] = self.W[gone[sub]].any(axis=1)
                self.total[gone[~sub]] = 0.0
            edge = ~only & ((db == lo) | (db == hi))
            if count_true(edge):
                self.rescan(dr[edge])

    # ------------------------------------------------------------ queries

    def percentiles(self, rows: np.ndarray, ps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(values (len(rows), len(ps)), non-empty mask)``: ``DecayingHistogram.percentiles``.

        The reference walks the buckets from the first non-empty one, adding
        weights until the sum reaches ``p * total`` (or taking the last
        non-empty bucket); here numpy's ``cumsum`` (a sequential loop per row in
        double precision: the same additions in the same order) over the rows'
        bucket window, and for each threshold the count of buckets whose running
        sum stays below it: the first bucket that reaches it.
        """
        ps_positive = min(ps.tolist()) > 0
        hi = self.hi[rows]
        nonempty = hi >= 0
        need = nonempty & ~self.fresh[rows]
        if count_true(need):
            sel = rows if all_true(need) else rows[need]
            lo, h = self.lo[sel], self.hi[sel]
            c0, c1 = int(lo.min()), int(h.max())
            W = self.W[sel, c0:c1 + 1]
            total = self.total[sel]
            if ps_positive and not count_true(self.subeps[sel]) and all_true(total > 0):
                cum = np.cumsum(W, axis=1)  # zeros before lo: below any positive threshold
            else:
                before = np.arange(c0, c1 + 1) < lo[:, None]
                cum = np.cumsum(np.where(before, 0.0, W), axis=1)
                cum[before] = -math.inf  # never reaches
            # every row's running sum never decreases (weights are >= 0): the buckets below a threshold come
            # first, and their count is the first bucket reaching it; none before hi reaches: hi
            thr = total[:, None] * ps  # p * total, as the reference
            found = (cum[:, None, :] < thr[:, :, None]).sum(axis=2)
            chosen = np.minimum(found + c0, h[:, None])
            vals = self.ends[chosen]
            self.pc[sel] = vals
            self.fresh[sel] = True
            if sel is rows:
                return vals, nonempty  # every row non-empty and recomputed
            out = self.pc[rows]
        else:
            out = self.pc[rows]
        if not all_true(nonempty):
            out[~nonempty] = 0.0
        return out, nonempty

    # ------------------------------------------------------------ state

    def to_state(self, row: int) -> dict[str, Any]:
        """``DecayingHistogram.to_state`` of one row."""
        w = self.W[row]
        idx = np.flatnonzero(w >= self.eps)
        flat: list[int] = []
        if idx.size:
            vals = w[idx].tolist()
            ratio = MAX_CHECKPOINT_WEIGHT / max(vals)
            prev = 0
            for b, v in zip(idx.tolist(), vals):
                n = math.floor(v * ratio + 0.5)
                if n > 0:
                    flat += (b - prev, n)
                    prev = b
        ref = float(self.ref[row])
        return {"r": None if math.isnan(ref) else ref, "t": float(f"{float(self.total[row]):.9g}"), "b": flat}

    def load(self, row: int, weights: Mapping[int, float], total: float, ref: float | None) -> None:
        w = self.W[row]
        w[:] = 0.0
        for b, v in weights.items():
            w[b] = v
        self.total[row] = total
        self.ref[row] = _NAN if ref is None else ref
        self.rescan(np.array([row]))

    def weights(self, row: int) -> dict[int, float]:
        w = self.W[row]
        idx = np.flatnonzero(w)
        return dict(zip(idx.tolist(), w[idx].tolist()))
