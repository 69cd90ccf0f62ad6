"""Online phases: clustering CRBM activations with stable ids (:class:`PhaseClusterer`), and per-phase usage
statistics (:class:`PhaseStats`: log-bucketed, mergeable). docs/phases.md, "The model".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from phasewise.models.phases.checkpoint import pack, unpack

__all__ = ["PhaseStats", "PhaseClusterer", "DEFAULT_QUANTILES"]

DEFAULT_QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99)


class PhaseStats:
    """Per-slot, per-resource usage histograms with quantiles, max and count.

    Parameters
    ----------
    n_slots
        Number of phase slots.
    resources
        Resource names, in the column order of the usage matrices.
    scales
        Per resource, the unit the histogram grid is expressed in (values are
        divided by it). The grid covers ``[1e-4, 1e9]`` units; smaller values
        fall in the zero bucket, larger ones in the top bucket.
    ratio
        Width of a bucket (upper / lower edge).
    half_life
        Per-phase decay: a phase's histogram halves its weight every
        ``half_life`` samples of that phase (``None``: no decay).

    Examples
    --------
    >>> import numpy as np
    >>> st = PhaseStats(2, resources=("cpu",), scales=(1.0,))
    >>> x = np.linspace(1.0, 2.0, 1001)[:, None]
    >>> st.update(np.zeros(1001, dtype=int), x)
    >>> round(float(st.quantiles(0, (0.5,))[0, 0]), 2)
    1.5
    >>> st.summary(0)["cpu"]["max"], st.summary(0)["cpu"]["count"]
    (2.0, 1001)
    """

    LO = 1e-4
    HI = 1e9

    def __init__(
        self,
        n_slots: int,
        resources: Sequence[str] = ("cpu", "mem", "gpu", "gpu_mem"),
        scales: Sequence[float] | None = None,
        ratio: float = 1.02,
        half_life: float | None = None,
    ) -> None:
        self.n_slots = int(n_slots)
        self.resources = tuple(resources)
        default_scales = {"cpu": 1.0, "mem": 2.0**20, "gpu": 1.0, "gpu_mem": 2.0**20}
        if scales is None:
            scales = [default_scales.get(r, 1.0) for r in self.resources]
        if len(scales) != len(self.resources):
            raise ValueError(f"{len(scales)} scales for {len(self.resources)} resources")
        self.scales = tuple(float(s) for s in scales)
        if ratio <= 1.0:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        self.ratio = float(ratio)
        self.half_life = half_life
        self._log_ratio = math.log(self.ratio)
        self.n_buckets = int(math.ceil(math.log(self.HI / self.LO) / self._log_ratio)) + 2
        # edges: bucket 0 = [0, LO); bucket b>=1 = [LO*r^(b-1), LO*r^b)
        upper = self.LO * self.ratio ** np.arange(self.n_buckets, dtype=np.float64)
        self._lower = np.concatenate([[0.0], upper[:-1]])
        self._upper = upper
        self._scale_arr = np.array(self.scales, dtype=np.float64)
        self._decay = 1.0 if half_life is None else 0.5 ** (1.0 / float(half_life))
        R = len(self.resources)
        self._hist = np.zeros((self.n_slots, R, self.n_buckets), dtype=np.float32)
        self._count = np.zeros((self.n_slots, R), dtype=np.int64)
        self._max = np.full((self.n_slots, R), np.nan, dtype=np.float64)

    # ------------------------------------------------------------------ updates
    def _bucket(self, X: np.ndarray) -> np.ndarray:
        v = X / self._scale_arr
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.floor(np.log(np.maximum(v, self.LO) / self.LO) / self._log_ratio) + 1
        b = np.where(v < self.LO, 0, b)
        return np.clip(np.nan_to_num(b, nan=0), 0, self.n_buckets - 1).astype(np.intp)

    def update(self, slots: np.ndarray, usage: np.ndarray) -> None:
        """Add usage rows ``(n, n_resources)`` to the given slots (negative slot or NaN skipped)."""
        slots = np.asarray(slots, dtype=np.intp).reshape(-1)
        U = np.asarray(usage, dtype=np.float64).reshape(len(slots), len(self.resources))
        keep = slots >= 0
        if not keep.all():
            slots, U = slots[keep], U[keep]
        if not len(slots):
            return
        ok = np.isfinite(U) & (U >= 0)
        if self._decay < 1.0:
            m = np.bincount(slots, minlength=self.n_slots)
            hit = m > 0
            self._hist[hit] *= (self._decay ** m[hit]).astype(np.float32)[:, None, None]
        B = self._bucket(np.where(ok, U, 0.0))
        rr = np.broadcast_to(np.arange(U.shape[1]), U.shape)
        ss = np.broadcast_to(slots[:, None], U.shape)
        np.add.at(self._hist, (ss[ok], rr[ok], B[ok]), 1.0)
        np.add.at(self._count, (ss[ok], rr[ok]), 1)
        Um = np.where(ok, U, -np.inf)
        cur = np.where(np.isnan(self._max), -np.inf, self._max)
        np.maximum.at(cur, (ss, rr), Um)
        self._max = np.where(np.isinf(cur), np.nan, cur)

    def merge_into(self, keep: int, drop: int) -> None:
        """Fold slot *drop* into slot *keep* and clear *drop*."""
        self._hist[keep] += self._hist[drop]
        self._count[keep] += self._count[drop]
        self._max[keep] = np.fmax(self._max[keep], self._max[drop])
        self.clear(drop)

    def clear(self, slot: int) -> None:
        """Forget a slot's statistics."""
        self._hist[slot] = 0.0
        self._count[slot] = 0
        self._max[slot] = np.nan

    # ------------------------------------------------------------------ queries
    def count(self, slot: int) -> np.ndarray:
        """Samples seen per resource for *slot* (undecayed)."""
        return self._count[slot].copy()

    def maximum(self, slot: int) -> np.ndarray:
        """Exact max per resource for *slot* (NaN if none)."""
        return self._max[slot].copy()

    def quantiles(self, slot: int, qs: Sequence[float]) -> np.ndarray:
        """Quantiles ``(len(qs), n_resources)`` of *slot*'s usage (NaN where no data)."""
        H = self._hist[slot].astype(np.float64)  # (R, B)
        cum = np.cumsum(H, axis=1)
        total = cum[:, -1]
        out = np.full((len(qs), H.shape[0]), np.nan)
        for i, q in enumerate(qs):
            target = q * total
            b = np.argmax(cum >= target[:, None] - 1e-12 * total[:, None], axis=1)
            below = np.where(b > 0, cum[np.arange(len(b)), b - 1], 0.0)
            inb = H[np.arange(len(b)), b]
            frac = np.clip(np.divide(target - below, inb, out=np.zeros_like(inb), where=inb > 0), 0.0, 1.0)
            lo, hi = self._lower[b], self._upper[b]
            val = np.where(b == 0, hi * frac, lo * (hi / np.maximum(lo, 1e-300)) ** frac)
            out[i] = np.where(total > 0, val * self._scale_arr, np.nan)
        # never report a quantile above the exact max (interpolation inside the top bucket)
        return np.fmin(out, self._max[slot][None, :])

    def summary(self, slot: int, qs: Sequence[float] = DEFAULT_QUANTILES) -> dict[str, dict[str, float]]:
        """``{resource: {"p50": .., "p90": .., "p95": .., "p99": .., "max": .., "count": ..}}``."""
        Q = self.quantiles(slot, qs)
        out: dict[str, dict[str, float]] = {}
        for r, name in enumerate(self.resources):
            if self._count[slot, r] == 0:
                continue
            d = {f"p{round(q * 100):d}": float(Q[i, r]) for i, q in enumerate(qs)}
            d["max"] = float(self._max[slot, r])
            d["count"] = int(self._count[slot, r])
            out[name] = d
        return out

    # ------------------------------------------------------------------ checkpoint
    def _meta(self) -> dict[str, Any]:
        return {
            "n_slots": self.n_slots,
            "resources": list(self.resources),
            "scales": list(self.scales),
            "ratio": self.ratio,
            "half_life": self.half_life,
        }

    def _arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        return {f"{prefix}hist": self._hist, f"{prefix}count": self._count, f"{prefix}max": self._max}

    def _load(self, arr: dict[str, np.ndarray], prefix: str = "") -> None:
        self._hist = arr[f"{prefix}hist"]
        self._count = arr[f"{prefix}count"]
        self._max = arr[f"{prefix}max"]


class PhaseClusterer:
    """Online k-means over activation vectors with stable phase ids and per-phase stats.

    Parameters
    ----------
    max_phases
        Bound on open phases; when full, far points join the nearest phase.
    new_phase_factor
        A point farther than ``new_phase_factor`` x (running RMS distance of
        points to their centroid) from every centroid opens a new phase.
    min_new_distance
        Floor of that distance (activation units; activations lie in [0, 1]).
    merge_factor
        Centroids closer than ``merge_factor`` x RMS distance merge (0: never).
    eta_min
        Floor of a centroid's learning rate (lets phases follow drift).
    rms_rate
        Rate of the running RMS distance (per point).
    resources, scales, stats_half_life
        Per-phase usage statistics (see :class:`PhaseStats`).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> a = rng.normal(0.2, 0.02, size=(200, 4))
    >>> b = rng.normal(0.8, 0.02, size=(200, 4))
    >>> cl = PhaseClusterer(max_phases=4, resources=("cpu",))
    >>> ids_a = cl.learn_many(a)
    >>> ids_b = cl.learn_many(b)
    >>> sorted(set(ids_a.tolist())), sorted(set(ids_b.tolist()))
    ([0], [1])
    >>> cl.predict_one(a[0]), cl.predict_one(b[0])
    (0, 1)
    """

    #: 2: relative statistics (``rel_stats``) added; version-1 checkpoints are refused
    VERSION = 2

    def __init__(
        self,
        max_phases: int = 12,
        new_phase_factor: float = 4.0,
        min_new_distance: float = 0.5,
        merge_factor: float = 1.0,
        eta_min: float = 0.01,
        rms_rate: float = 0.01,
        resources: Sequence[str] = ("cpu", "mem", "gpu", "gpu_mem"),
        scales: Sequence[float] | None = None,
        stats_half_life: float | None = None,
    ) -> None:
        if max_phases < 1:
            raise ValueError(f"max_phases must be >= 1, got {max_phases}")
        self.max_phases = int(max_phases)
        self.new_phase_factor = float(new_phase_factor)
        self.min_new_distance = float(min_new_distance)
        self.merge_factor = float(merge_factor)
        self.eta_min = float(eta_min)
        self.rms_rate = float(rms_rate)
        self.resources = tuple(resources)
        self.scales = None if scales is None else tuple(scales)
        self.stats_half_life = stats_half_life
        self._dim = 0
        self._centroids = np.zeros((self.max_phases, 0))
        self._n = np.zeros(self.max_phases, dtype=np.float64)
        self._ids = np.full(self.max_phases, -1, dtype=np.int64)
        self._next_id = 0
        self._rms2 = 0.0
        self.stats = PhaseStats(self.max_phases, self.resources, self.scales, half_life=stats_half_life)
        #: usage / level (dimensionless) per phase and resource
        self.rel_stats = PhaseStats(self.max_phases, self.resources, [1.0] * len(self.resources),
                                    half_life=stats_half_life)

    # ------------------------------------------------------------------ state
    @property
    def n_phases(self) -> int:
        """Phases open now."""
        return int((self._ids >= 0).sum())

    @property
    def phase_ids(self) -> list[int]:
        """Ids of the open phases, oldest first."""
        return sorted(int(i) for i in self._ids[self._ids >= 0])

    @property
    def new_phase_distance(self) -> float:
        """The distance beyond which a point opens a new phase, now."""
        return max(self.min_new_distance, self.new_phase_factor * math.sqrt(self._rms2))

    def centroid(self, phase_id: int) -> np.ndarray:
        """The centroid of a phase."""
        return self._centroids[self.slot_of(phase_id)].copy()

    def slot_of(self, phase_id: int) -> int:
        """Internal slot of an open phase id (``KeyError`` if not open)."""
        hit = np.flatnonzero(self._ids == phase_id)
        if not len(hit):
            raise KeyError(f"phase {phase_id} is not open (open: {self.phase_ids})")
        return int(hit[0])

    def slots_of(self, phase_ids: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`slot_of`; unknown ids map to -1."""
        phase_ids = np.asarray(phase_ids, dtype=np.int64)
        match = self._ids[None, :] == phase_ids[:, None]
        return np.where(match.any(1), match.argmax(1), -1)

    # ------------------------------------------------------------------ core
    def _check(self, H: np.ndarray) -> np.ndarray:
        H = np.asarray(H, dtype=np.float64)
        if H.ndim == 1:
            H = H[None, :]
        if self._dim == 0 and H.shape[1]:
            self._dim = H.shape[1]
            self._centroids = np.zeros((self.max_phases, self._dim))
        if H.shape[1] != self._dim:
            raise ValueError(f"expected activation vectors of {self._dim} values, got {H.shape[1]}")
        if not np.isfinite(H).all():
            raise ValueError("activation vectors contain NaN or infinite values")
        return H

    def _nearest(self, H: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        active = self._ids >= 0
        if not active.any():
            return np.full(len(H), -1, dtype=np.intp), np.full(len(H), np.inf)
        C = self._centroids
        D2 = (H * H).sum(1)[:, None] - 2.0 * H @ C.T + (C * C).sum(1)[None, :]
        D2 = np.where(active[None, :], np.maximum(D2, 0.0), np.inf)
        j = D2.argmin(1)
        return j, np.sqrt(D2[np.arange(len(H)), j])

    def _open(self, h: np.ndarray) -> int:
        slot = int(np.flatnonzero(self._ids < 0)[0])
        self._ids[slot] = self._next_id
        self._next_id += 1
        self._centroids[slot] = h
        self._n[slot] = 0.0
        self.stats.clear(slot)
        self.rel_stats.clear(slot)
        return slot

    def learn_many(self, H: np.ndarray) -> np.ndarray:
        """Learn a batch of activation vectors; returns their phase ids (after learning)."""
        H = self._check(H)
        if not len(H):
            return np.zeros(0, dtype=np.int64)
        j, d = self._nearest(H)
        while True:
            far = d > self.new_phase_distance
            if not far.any() or self.n_phases >= self.max_phases:
                break
            self._open(H[int(np.flatnonzero(far)[0])])
            j, d = self._nearest(H)
        # running RMS of distances to the assigned centroid
        w = 1.0 - (1.0 - self.rms_rate) ** len(H)
        self._rms2 = (1.0 - w) * self._rms2 + w * float((d * d).mean())
        # centroid updates: exact running mean, floored at eta_min per point
        m = np.bincount(j, minlength=self.max_phases).astype(np.float64)
        sums = np.zeros_like(self._centroids)
        np.add.at(sums, j, H)
        hit = m > 0
        means = sums[hit] / m[hit, None]
        n_new = self._n[hit] + m[hit]
        eta = np.maximum(m[hit] / n_new, 1.0 - (1.0 - self.eta_min) ** m[hit])
        self._centroids[hit] += eta[:, None] * (means - self._centroids[hit])
        self._n[hit] = n_new
        self._merge()
        return self.predict_many(H)

    def _merge(self) -> None:
        if self.merge_factor <= 0 or self.n_phases < 2:
            return
        limit = self.merge_factor * math.sqrt(self._rms2)
        while True:
            act = np.flatnonzero(self._ids >= 0)
            C = self._centroids[act]
            D = np.sqrt(((C[:, None, :] - C[None, :, :]) ** 2).sum(-1))
            np.fill_diagonal(D, np.inf)
            a, b = np.unravel_index(D.argmin(), D.shape)
            if D[a, b] >= limit:
                return
            sa, sb = int(act[a]), int(act[b])
            keep, drop = (sa, sb) if self._ids[sa] < self._ids[sb] else (sb, sa)
            n = self._n[keep] + self._n[drop]
            if n > 0:
                self._centroids[keep] = (
                    self._n[keep] * self._centroids[keep] + self._n[drop] * self._centroids[drop]
                ) / n
            self._n[keep] = n
            self.stats.merge_into(keep, drop)
            self.rel_stats.merge_into(keep, drop)
            self._ids[drop] = -1
            self._n[drop] = 0.0

    def learn_one(self, h: Sequence[float]) -> int:
        """Learn one activation vector; returns its phase id."""
        return int(self.learn_many(np.asarray(h, dtype=np.float64)[None, :])[0])

    def predict_many(self, H: np.ndarray) -> np.ndarray:
        """Phase id of the nearest open centroid per row (-1 while none is open)."""
        H = self._check(H)
        j, _ = self._nearest(H)
        return np.where(j >= 0, self._ids[np.maximum(j, 0)], -1)

    def predict_one(self, h: Sequence[float]) -> int:
        """Phase id of one activation vector."""
        return int(self.predict_many(np.asarray(h, dtype=np.float64)[None, :])[0])

    # ------------------------------------------------------------------ statistics
    def update_stats(self, phase_ids: np.ndarray, usage: np.ndarray) -> None:
        """Add usage rows ``(n, n_resources)`` to the statistics of the given phase ids."""
        self.stats.update(self.slots_of(np.asarray(phase_ids).reshape(-1)), usage)

    def update_rel_stats(self, phase_ids: np.ndarray, ratios: np.ndarray) -> None:
        """Add usage/level rows ``(n, n_resources)`` to the relative statistics of the given phase ids."""
        self.rel_stats.update(self.slots_of(np.asarray(phase_ids).reshape(-1)), ratios)

    def phase_stats(self, phase_id: int, qs: Sequence[float] = DEFAULT_QUANTILES) -> dict:
        """Usage statistics of a phase (empty dict if the phase is not open)."""
        s = self.slots_of(np.array([phase_id]))[0]
        return {} if s < 0 else self.stats.summary(int(s), qs)

    # ------------------------------------------------------------------ checkpoint
    def _params(self) -> dict[str, Any]:
        return {
            "max_phases": self.max_phases,
            "new_phase_factor": self.new_phase_factor,
            "min_new_distance": self.min_new_distance,
            "merge_factor": self.merge_factor,
            "eta_min": self.eta_min,
            "rms_rate": self.rms_rate,
            "resources": list(self.resources),
            "scales": None if self.scales is None else list(self.scales),
            "stats_half_life": self.stats_half_life,
        }

    def to_bytes(self) -> bytes:
        """Versioned checkpoint: centroids, ids, counts and statistics."""
        meta = {"params": self._params(), "dim": self._dim, "next_id": self._next_id, "rms2": self._rms2}
        arrays = {"centroids": self._centroids, "n": self._n, "ids": self._ids, **self.stats._arrays("s_"),
                  **self.rel_stats._arrays("r_")}
        return pack("PhaseClusterer", self.VERSION, meta, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> PhaseClusterer:
        """Load a checkpoint written by :meth:`to_bytes` (same version only)."""
        meta, arr = unpack(data, "PhaseClusterer", cls.VERSION)
        obj = cls(**meta["params"])
        obj._dim = int(meta["dim"])
        obj._next_id = int(meta["next_id"])
        obj._rms2 = float(meta["rms2"])
        obj._centroids, obj._n, obj._ids = arr["centroids"], arr["n"], arr["ids"]
        obj.stats._load(arr, "s_")
        obj.rel_stats._load(arr, "r_")
        return obj

    def clone(self) -> PhaseClusterer:
        """An independent copy."""
        return self.from_bytes(self.to_bytes())
