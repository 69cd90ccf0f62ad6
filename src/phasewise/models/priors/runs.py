"""The signed runs in the VPA updater's step (pure): each run's profile from its samples, and the prior
limits of a young run (:class:`~phasewise.models.priors.book.PriorBook`). The arrays are the
:class:`~phasewise.models.vpa.state.StateCache`'s (``_x_*``, one row per container). docs/priors.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from phasewise.kit.records import ContainerSample, ExecutionProfile, HostSamples
from phasewise.models.arrays import count_true
from phasewise.models.priors.book import Prior

__all__ = ["apply_priors", "signatures", "track_runs"]

_NAN = math.nan


def signatures(cs: Sequence[ContainerSample]) -> list[str | None] | None:
    """Each sample's workload signature; ``None`` when none has one (one pass, the usual case)."""
    if not any((w := c.workload) is not None and w.signature is not None for c in cs):
        return None
    return [None if c.workload is None else c.workload.signature for c in cs]


def track_runs(cache: Any, msgs: Sequence[HostSamples], mi: list[int] | None,
                cs: Sequence[ContainerSample], rows: np.ndarray, ts: float | np.ndarray, x: np.ndarray,
                sig: list[str | None], interval: float) -> None:
    """The signed runs' profiles take the wave's samples; those due are handed out (and learned by the
    cache's own book at once: a worker needs no round trip through the topic for its own runs)."""
    sidx = np.array([i for i, s in enumerate(sig) if s is not None], dtype=np.intp)
    r = rows[sidx]
    t = np.broadcast_to(np.asarray(ts, dtype=np.float64), (len(rows),))[sidx]
    start = cache._x_start[r]
    new = np.isnan(start)
    cache._x_start[r] = np.where(new, t, start)
    cache._x_n[r] = np.where(new, 0.0, np.nan_to_num(cache._x_n[r])) + 1.0
    cache._x_cpu[r] = np.fmax(np.where(new, _NAN, cache._x_cpu[r]), x[sidx, 0])
    cache._x_mem[r] = np.fmax(np.where(new, _NAN, cache._x_mem[r]), x[sidx, 1])
    nxt = cache._x_pub[r]
    nxt = np.where(np.isnan(nxt), t + interval, nxt)  # new (or reloaded): the first one an interval on
    due = t >= nxt
    cache._x_pub[r] = np.where(due, t + interval, nxt)
    if not count_true(due):
        return
    book = cache.priors
    for k in np.flatnonzero(due).tolist():
        i, row = int(sidx[k]), int(r[k])
        msg = msgs[0] if mi is None else msgs[mi[i]]
        p = ExecutionProfile(signature=sig[i], host=msg.host, container=cs[i].container, ts=float(t[k]),
                             start=float(cache._x_start[row]), samples=int(cache._x_n[row]),
                             cpu_peak_cores=float(cache._x_cpu[row]), mem_peak_bytes=float(cache._x_mem[row]))
        cache.profiles.append(p)
        if book is not None:
            book.learn(p)


def apply_priors(cache: Any, sig: list[str | None], at: np.ndarray, dr: np.ndarray,
                  tsd: float | np.ndarray, keys: list[str], pub: np.ndarray | None, lim_cpu: np.ndarray,
                  lim_mem: np.ndarray, until: float) -> tuple[np.ndarray, list[Prior | None]]:
    """For due rows of young signed runs whose signature has a prior: the prior's limits, never under the
    run's own peaks x (1 + margin), written into *lim_cpu* / *lim_mem*; which rows, and their priors."""
    n = len(dr)
    t = np.broadcast_to(np.asarray(tsd, dtype=np.float64), (n,))
    young = t - cache._x_start[dr] < until  # NaN (no signed run) compares False
    known = np.zeros(n, dtype=bool)
    out: list[Prior | None] = [None] * n
    book = cache.priors
    if book is None or not count_true(young):
        return known, out
    got = []
    for j in np.flatnonzero(young).tolist():
        i = int(at[j])
        s = sig[i]
        if s is None or (pub is not None and not pub[i]):
            continue
        p = book.prior(s, exclude=keys[i])
        if p is not None:
            got.append((j, p))
    if not got:
        return known, out
    jj = np.array([j for j, _ in got], dtype=np.intp)
    m = np.array([1.0 + p.margin for _, p in got])
    rows = dr[jj]
    lim_cpu[jj] = np.maximum([p.cpu_cores for _, p in got], np.nan_to_num(cache._x_cpu[rows]) * m)
    lim_mem[jj] = np.maximum([p.mem_bytes for _, p in got], np.nan_to_num(cache._x_mem[rows]) * m)
    known[jj] = True
    for j, p in got:
        out[j] = p
    return known, out
