"""Reactive moving-window limit policies (max or p95 of the last samples, times a margin): the baselines phase
limits must beat. :func:`window_family` is replay's family; the oracle lives in the replay harness.
docs/results.md, "How the scores are computed".
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

from phasewise.models.policy import Limits, Usage

__all__ = ["STATS", "WindowPolicy", "percentile", "window_family"]

#: statistic name -> default margin used by :func:`window_family`
STATS: dict[str, float] = {"max": 1.0, "p95": 1.15}


def percentile(sorted_values: list[float], q: float) -> float:
    """The *q*-th percentile (0-100) of already sorted values, linear
    interpolation between closest ranks (numpy's default method).

    >>> percentile([1.0, 2.0, 3.0, 4.0], 95)
    3.85
    """
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


class WindowPolicy:
    """Limit = statistic of the last ``window`` observed samples x ``margin``.

    Parameters
    ----------
    window
        Number of most recent samples of each resource kept (>= 1).
    stat
        ``"max"`` or ``"p95"`` (95th percentile, numpy's linear method).
    margin
        Factor applied to the statistic (> 0).

    A resource gets a limit once at least one sample of it was observed; before
    that its limit is ``None`` (no opinion). Each resource keeps its own window
    of its own samples, so a step without a value for one resource does not
    shift that resource's window.

    Examples
    --------
    >>> p = WindowPolicy(window=3, stat="max")
    >>> p.name
    'window-max-3'
    >>> p.limits(0.0)
    {}
    >>> for t, cpu in enumerate([1.0, 4.0, 2.0, 3.0]):
    ...     p.observe(float(t), {"cpu": cpu})
    >>> p.limits(4.0)  # max of the last 3 samples: 4, 2, 3
    {'cpu': 4.0}
    >>> q = WindowPolicy(window=4, stat="p95", margin=1.15)
    >>> for t, cpu in enumerate([1.0, 2.0, 3.0, 4.0]):
    ...     q.observe(float(t), {"cpu": cpu})
    >>> round(q.limits(4.0)["cpu"], 4)  # 3.85 x 1.15
    4.4275
    """

    def __init__(self, window: int = 10, stat: str = "max", margin: float = 1.0) -> None:
        if int(window) != window or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
        if not margin > 0:
            raise ValueError(f"margin must be > 0, got {margin!r}")
        self.window = int(window)
        self.stat = stat
        self.margin = float(margin)
        self.name = f"window-{stat}-{self.window}" if margin == 1.0 else f"window-{stat}x{margin:g}-{self.window}"
        self._recent: dict[str, deque[float]] = {}
        self._sorted: dict[str, list[float]] = {}
        self._last_t: float | None = None

    def observe(self, t: float, usage: Usage) -> None:
        """Add the usage measured at *t* (resources absent or ``NaN`` are skipped)."""
        for r, v in usage.items():
            if v is None or math.isnan(v):
                continue
            v = float(v)
            q = self._recent.get(r)
            if q is None:
                q = self._recent[r] = deque()
                self._sorted[r] = []
            s = self._sorted[r]
            if len(q) == self.window:
                old = q.popleft()
                del s[bisect.bisect_left(s, old)]
            q.append(v)
            bisect.insort(s, v)
        self._last_t = t

    def _limit(self, r: str) -> float:
        s = self._sorted[r]
        v = s[-1] if self.stat == "max" else percentile(s, 95.0)
        return v * self.margin

    def limits(self, t: float) -> Limits:
        """Limits for the step starting at *t*, from samples observed before it."""
        return {r: self._limit(r) for r in self._recent}

    def explain(self) -> dict:
        """Window contents behind the latest limits."""
        return {
            "policy": self.name,
            "window": self.window,
            "stat": self.stat,
            "margin": self.margin,
            "samples": {r: len(q) for r, q in self._recent.items()},
            "last_observed_t": self._last_t,
        }

    def __repr__(self) -> str:
        return f"WindowPolicy(window={self.window}, stat={self.stat!r}, margin={self.margin})"


def window_family(windows: tuple[int, ...] = (5, 10, 30, 60)) -> dict[str, Callable[[], WindowPolicy]]:
    """Member name -> factory of a fresh policy, for max x 1.0 and p95 x 1.15 over *windows*.

    >>> sorted(window_family((5, 10)))
    ['window-max-10', 'window-max-5', 'window-p95x1.15-10', 'window-p95x1.15-5']
    """
    out: dict[str, Callable[[], WindowPolicy]] = {}
    for stat, margin in STATS.items():
        for w in windows:
            name = WindowPolicy(w, stat, margin).name
            out[name] = (lambda w=w, stat=stat, margin=margin: WindowPolicy(w, stat, margin))
    return out
