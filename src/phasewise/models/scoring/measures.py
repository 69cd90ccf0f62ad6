"""Score limits against measured usage: allocation over usage, and fulfilment, by the same rules for every policy.

Pure numpy; :class:`Score` parts add up across containers. The measures, the
step durations and the common start: docs/results.md, "How the scores are
computed".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Score", "common_start", "hold_last", "score_rows", "score_steps", "step_durations",
           "step_durations_rows"]


@dataclass(frozen=True)
class Score:
    """Additive parts of a score; sum them over containers with ``+``.

    Examples
    --------
    >>> import numpy as np
    >>> s = score_steps(np.array([0., 10., 20.]), used=np.array([1., 2., 1.]),
    ...                 limit=np.array([2., 1., 1.]))
    >>> (s.alloc, s.used, s.fulfilled, s.steps)
    (40.0, 40.0, 2, 3)
    >>> s.alloc_over_used, round(s.fulfilment, 3)
    (1.0, 0.667)
    """

    alloc: float = 0.0  # sum of L * dt
    used: float = 0.0  # sum of U * dt
    fulfilled: int = 0  # steps with U <= L
    steps: int = 0

    def __add__(self, other: Score) -> Score:
        return Score(self.alloc + other.alloc, self.used + other.used,
                     self.fulfilled + other.fulfilled, self.steps + other.steps)

    @property
    def alloc_over_used(self) -> float | None:
        """``sum(L dt) / sum(U dt)``; ``None`` when nothing was used (ratio undefined)."""
        return self.alloc / self.used if self.used > 0 else None

    @property
    def fulfilment(self) -> float | None:
        """Share of scored steps with ``U <= L``; ``None`` when no step was scored."""
        return self.fulfilled / self.steps if self.steps else None

    @staticmethod
    def total(scores: Iterable[Score]) -> Score:
        out = Score()
        for s in scores:
            out = out + s
        return out


def step_durations(t: np.ndarray, median_dt: float | None = None,
                   max_gap_factor: float = 5.0) -> np.ndarray:
    """Time from each sample to the next; the last gets the median step.

    Gaps longer than ``max_gap_factor`` x median count as one median step.
    *median_dt* is used when the series has fewer than two samples (or to
    impose one); it must then be given.

    >>> step_durations(np.array([0., 10., 30., 40.]))
    array([10., 20., 10., 10.])
    >>> step_durations(np.array([0., 10., 20., 1000., 1010.]))  # 980 s gap -> 10
    array([10., 10., 10., 10., 10.])
    """
    t = np.asarray(t, dtype=np.float64)
    if t.ndim != 1:
        raise ValueError("t must be one-dimensional")
    d = np.diff(t)
    if np.any(d <= 0):
        raise ValueError("timestamps must be strictly increasing")
    med = float(np.median(d)) if median_dt is None and len(d) else median_dt
    if med is None:
        raise ValueError("a series of one sample needs median_dt")
    out = np.append(d, med)
    out[out > max_gap_factor * med] = med
    return out


def hold_last(limit: Sequence[float | None] | np.ndarray) -> np.ndarray:
    """Limits as floats, each ``None``/``NaN`` after the first limit replaced by the
    previous limit (leading ones stay ``NaN``).

    >>> hold_last([None, 2.0, None, 3.0, float("nan")])
    array([nan,  2.,  2.,  3.,  3.])
    """
    a = np.array([np.nan if v is None else v for v in limit], dtype=np.float64)
    ok = ~np.isnan(a)
    idx = np.where(ok, np.arange(len(a)), -1)
    np.maximum.accumulate(idx, out=idx)
    out = np.full(len(a), np.nan)
    has = idx >= 0
    out[has] = a[idx[has]]
    return out


def common_start(limits: Iterable[np.ndarray]) -> int:
    """First index at which every limit series has a value (after :func:`hold_last`);
    the length of the series when some policy never sets one.

    >>> common_start([np.array([np.nan, 1., 1.]), np.array([np.nan, np.nan, 2.])])
    2
    """
    start, n = 0, None
    for a in limits:
        n = len(a)
        ok = np.flatnonzero(~np.isnan(a))
        start = max(start, int(ok[0]) if len(ok) else len(a))
    return start if n is not None else 0


def score_steps(t: np.ndarray, used: np.ndarray, limit: np.ndarray,
                start: int = 0, median_dt: float | None = None,
                max_gap_factor: float = 5.0) -> Score:
    """Score one resource of one container from step *start* on.

    *t*, *used* and *limit* are aligned arrays of the steps where the resource
    has a value; *limit* must have a value at every scored step (apply
    :func:`hold_last` and :func:`common_start` first).
    """
    t = np.asarray(t, dtype=np.float64)
    used = np.asarray(used, dtype=np.float64)
    limit = np.asarray(limit, dtype=np.float64)
    if not (len(t) == len(used) == len(limit)):
        raise ValueError(f"length mismatch: t={len(t)} used={len(used)} limit={len(limit)}")
    if len(t) == 0 or start >= len(t):
        return Score()
    if len(t) == 1 and median_dt is None:
        raise ValueError("a series of one sample needs median_dt")
    dt = step_durations(t, median_dt=median_dt, max_gap_factor=max_gap_factor)[start:]
    u, lim = used[start:], limit[start:]
    if np.any(np.isnan(u)):
        raise ValueError("used has missing values at scored steps")
    if np.any(np.isnan(lim)):
        raise ValueError("limit has missing values at scored steps (apply hold_last/common_start)")
    return Score(alloc=float(np.dot(lim, dt)), used=float(np.dot(u, dt)),
                 fulfilled=int(np.count_nonzero(u <= lim)), steps=len(u))


def score_rows(t: np.ndarray, used: np.ndarray, limit: np.ndarray, n: np.ndarray, start: np.ndarray,
               max_gap_factor: float = 5.0, lo: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`score_steps` of many series at once: ``(alloc, used, fulfilled, steps)``, one entry per row.

    Row ``i`` is the series ``t[i, lo[i]:n[i]]`` (strictly increasing; *lo*
    defaults to 0), ``used`` on the same slots and ``limit`` (after
    :func:`hold_last`), scored from slot ``start[i]`` (>= ``lo[i]``) on; other
    slots are ignored. *limit* may carry a last axis of several policies
    ``(N, K, P)``: the results are then ``(N, P)`` and a policy's ``NaN``
    limits score nothing (a policy with no limit in a row: all zeros). A row
    of fewer than two samples has no step duration and scores nothing
    (:func:`score_steps` would need ``median_dt``). The same numbers as
    :func:`score_steps` row by row (tested).

    >>> t = np.array([[0., 10., 20., np.nan], [0., 5., 10., 15.]])
    >>> u = np.array([[1., 2., 1., np.nan], [1., 1., 1., 1.]])
    >>> lim = np.array([[2., 1., 1., np.nan], [1., 1., 1., 1.]])
    >>> a, us, f, k = score_rows(t, u, lim, n=np.array([3, 4]), start=np.array([0, 1]))
    >>> a.tolist(), us.tolist(), f.tolist(), k.tolist()
    ([40.0, 15.0], [40.0, 15.0], [2, 3], [3, 3])
    """
    t = np.asarray(t, dtype=np.float64)
    N, K = t.shape
    lim = np.asarray(limit, dtype=np.float64)
    flat = lim.ndim == 2
    if flat:
        lim = lim[:, :, None]
    P = lim.shape[2]
    n = np.asarray(n, dtype=np.intp)
    start = np.asarray(start, dtype=np.intp)
    lo = np.zeros(N, dtype=np.intp) if lo is None else np.asarray(lo, dtype=np.intp)
    alloc, use = np.zeros((N, P)), np.zeros((N, P))
    fulfilled, steps = np.zeros((N, P), dtype=np.int64), np.zeros((N, P), dtype=np.int64)
    ok = (n - lo >= 2) & (start < n)
    if K >= 2 and ok.any():
        rows = slice(None) if ok.all() else np.flatnonzero(ok)
        u, lim_r, n_r, lo_r = np.asarray(used, np.float64)[rows], lim[rows], n[rows], lo[rows]
        dt = step_durations_rows(t[rows], lo_r, n_r, max_gap_factor)
        j = np.arange(K)
        scored = (j[None, :] >= np.maximum(start[rows], lo_r)[:, None]) & (j[None, :] < n_r[:, None])
        sc = scored[:, :, None] & ~np.isnan(lim_r)
        dt0 = np.where(scored, dt, 0.0)  # NaN outside each series
        scf = sc.astype(np.float64)
        alloc[rows] = np.einsum("nkp,nk->np", np.where(sc, lim_r, 0.0), dt0)
        use[rows] = np.einsum("nkp,nk->np", scf, np.where(scored, u, 0.0) * dt0)
        with np.errstate(invalid="ignore"):
            fulfilled[rows] = np.einsum("nkp->np", (sc & (u[:, :, None] <= lim_r)).astype(np.int64))
        steps[rows] = np.einsum("nkp->np", sc.astype(np.int64))
    if flat:
        return alloc[:, 0], use[:, 0], fulfilled[:, 0], steps[:, 0]
    return alloc, use, fulfilled, steps


def step_durations_rows(t: np.ndarray, lo: np.ndarray, n: np.ndarray, max_gap_factor: float = 5.0) -> np.ndarray:
    """:func:`step_durations` of each row's series ``t[i, lo[i]:n[i]]`` (at least two samples), ``NaN`` elsewhere.

    >>> step_durations_rows(np.array([[0., 10., 30., 40.], [5., 0., 10., 20.]]), np.array([0, 1]),
    ...                     np.array([4, 4]))
    array([[10., 20., 10., 10.],
           [nan, 10., 10., 10.]])
    """
    N, K = t.shape
    j = np.arange(K)
    d = np.diff(t, axis=1)
    d = np.where((j[None, :-1] >= lo[:, None]) & (j[None, :-1] + 1 < n[:, None]), d, np.nan)
    srt = np.sort(d, axis=1)  # NaN last
    k = n - lo - 1  # diffs per row
    ar = np.arange(N)
    med = (srt[ar, (k - 1) // 2] + srt[ar, k // 2]) / 2  # np.median's middle (mean of the two for an even count)
    dt = np.concatenate([d, np.full((N, 1), np.nan)], axis=1)
    dt[ar, n - 1] = med
    return np.where(dt > max_gap_factor * med[:, None], med[:, None], dt)
