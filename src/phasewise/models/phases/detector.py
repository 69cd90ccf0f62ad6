"""Pure, vectorised phase detection over many containers (used live and in replay).

:class:`PhaseModel` is the snapshot every detector shares (normaliser, CRBM,
clusterer); :class:`Windows` holds each container's last frames; :func:`detect`
is the hot path: one batched CRBM call and one nearest-centroid call per
batch of frames. docs/phases.md, "Detection".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from phasewise.models.arrays import grown
from phasewise.models.phases.checkpoint import pack, unpack
from phasewise.models.phases.clusterer import DEFAULT_QUANTILES, PhaseClusterer
from phasewise.models.phases.crbm import CRBM
from phasewise.models.phases.features import FEATURES
from phasewise.models.phases.normalize import OnlineNormalizer

__all__ = ["PhaseModel", "Windows", "DetectResult", "detect", "learn", "relative_usage"]

_LOG = {"cpu": True, "mem": True, "gpu": False, "gpu_mem": True}


class PhaseModel:
    """The snapshot shared by detectors: normaliser + CRBM + phase clusterer.

    Parameters
    ----------
    features
        Frame features, a subset of :data:`FEATURES` in that order
        (``("cpu", "mem")`` for CPU-only containers, all four with GPUs).
    n_hid, n_his, sigma, lr, momentum, weight_decay, k
        CRBM parameters (see :class:`~phasewise.models.phases.crbm.CRBM`).
    warmup
        Windows the CRBM learns before the clusterer starts; phases are -1
        until then.
    max_phases, new_phase_factor, min_new_distance, merge_factor, eta_min
        Clusterer parameters (see :class:`~phasewise.models.phases.clusterer.PhaseClusterer`).
    stats_half_life
        Per-phase decay of the usage statistics, in samples (``None``: none).
    seed
        Seed of the CRBM.

    Examples
    --------
    >>> import numpy as np
    >>> m = PhaseModel(features=("cpu", "mem"), n_hid=6, n_his=2, warmup=32, seed=0)
    >>> rng = np.random.default_rng(0)
    >>> idle = np.c_[rng.uniform(0.0, 0.05, 64), rng.uniform(1e7, 2e7, 64)]
    >>> busy = np.c_[rng.uniform(0.9, 1.1, 64), rng.uniform(8e8, 9e8, 64)]
    >>> W = np.concatenate([idle, busy])[np.arange(128)[:, None] + [0, 0, 0]]  # constant windows
    >>> for _ in range(5):
    ...     _ = learn(m, W)
    >>> ph = m.predict(W)
    >>> bool(ph[0] != ph[-1]) and len(set(ph[:64].tolist())) == 1
    True
    """

    #: 2: the clusterer carries relative statistics; version-1 snapshots are refused with a CheckpointError
    VERSION = 2

    def __init__(
        self,
        features: Sequence[str] = ("cpu", "mem"),
        n_hid: int = 10,
        n_his: int = 3,
        sigma: float = 0.5,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 2e-4,
        k: int = 1,
        warmup: int = 256,
        max_phases: int = 12,
        new_phase_factor: float = 4.0,
        min_new_distance: float = 0.5,
        merge_factor: float = 1.0,
        eta_min: float = 0.01,
        stats_half_life: float | None = None,
        seed: int | None = 0,
    ) -> None:
        unknown = [f for f in features if f not in FEATURES]
        if unknown or not features:
            raise ValueError(f"features must be a non-empty subset of {list(FEATURES)}, got {list(features)}")
        self.features = tuple(f for f in FEATURES if f in features)
        self.n_hid, self.n_his, self.sigma, self.lr = n_hid, n_his, sigma, lr
        self.momentum, self.weight_decay, self.k = momentum, weight_decay, k
        self.warmup = int(warmup)
        self.max_phases, self.new_phase_factor = max_phases, new_phase_factor
        self.min_new_distance, self.merge_factor, self.eta_min = min_new_distance, merge_factor, eta_min
        self.stats_half_life = stats_half_life
        self.seed = seed
        n = len(self.features)
        self.normalizer = OnlineNormalizer(n, log_features=[_LOG[f] for f in self.features])
        self.crbm = CRBM(
            n_vis=n, n_hid=n_hid, n_his=n_his, sigma=sigma, lr=lr, momentum=momentum,
            weight_decay=weight_decay, k=k, seed=seed,
        )
        self.clusterer = PhaseClusterer(
            max_phases=max_phases, new_phase_factor=new_phase_factor, min_new_distance=min_new_distance,
            merge_factor=merge_factor, eta_min=eta_min, resources=self.features, stats_half_life=stats_half_life,
        )

    @property
    def n_features(self) -> int:
        return len(self.features)

    @property
    def window_len(self) -> int:
        """Frames per window: ``n_his + 1``."""
        return self.n_his + 1

    @property
    def ready(self) -> bool:
        """True once the CRBM finished warm-up and at least one phase is open."""
        return self.crbm.n_seen >= self.warmup and self.clusterer.n_phases > 0

    def activations(self, windows: np.ndarray) -> np.ndarray:
        """Hidden activations of raw windows ``(n, n_his + 1, n_features)``: one CRBM call."""
        Z = self.normalizer.transform_many(windows).reshape(len(windows), -1)
        with torch.inference_mode():
            return self.crbm.predict_many(Z.astype(np.float32))

    def predict(self, windows: np.ndarray) -> np.ndarray:
        """Phase ids of raw windows (-1 while the model is not ready)."""
        windows = np.asarray(windows)
        if not self.ready or not len(windows):
            return np.full(len(windows), -1, dtype=np.int64)
        return self.clusterer.predict_many(self.activations(windows))

    # ------------------------------------------------------------------ checkpoint
    def _params(self) -> dict[str, Any]:
        return {
            "features": list(self.features), "n_hid": self.n_hid, "n_his": self.n_his, "sigma": self.sigma,
            "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay, "k": self.k,
            "warmup": self.warmup, "max_phases": self.max_phases, "new_phase_factor": self.new_phase_factor,
            "min_new_distance": self.min_new_distance, "merge_factor": self.merge_factor,
            "eta_min": self.eta_min, "stats_half_life": self.stats_half_life, "seed": self.seed,
        }

    def to_bytes(self) -> bytes:
        """Versioned snapshot holding the three components' own versioned checkpoints."""
        parts = {
            "normalizer": np.frombuffer(self.normalizer.to_bytes(), dtype=np.uint8),
            "crbm": np.frombuffer(self.crbm.to_bytes(), dtype=np.uint8),
            "clusterer": np.frombuffer(self.clusterer.to_bytes(), dtype=np.uint8),
        }
        return pack("PhaseModel", self.VERSION, {"params": self._params()}, parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> PhaseModel:
        """Load a snapshot; any version mismatch raises ``CheckpointError``."""
        meta, arr = unpack(data, "PhaseModel", cls.VERSION)
        obj = cls(**meta["params"])
        obj.normalizer = OnlineNormalizer.from_bytes(arr["normalizer"].tobytes())
        obj.crbm = CRBM.from_bytes(arr["crbm"].tobytes())
        obj.clusterer = PhaseClusterer.from_bytes(arr["clusterer"].tobytes())
        return obj

    def clone(self) -> PhaseModel:
        """An independent copy."""
        return self.from_bytes(self.to_bytes())


class Windows:
    """Per-container ring of the last ``window_len`` raw frames, phase and since.

    Rows are allocated on first sight and kept (``forget`` releases one).
    State per container: ``window_len * n_features`` float32 values, a fill
    count, the current phase and the event time it began.
    """

    def __init__(self, window_len: int, n_features: int, capacity: int = 64) -> None:
        self.window_len = int(window_len)
        self.n_features = int(n_features)
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        cap = max(1, int(capacity))
        self.frames = np.zeros((cap, self.window_len, self.n_features), dtype=np.float32)
        self.filled = np.zeros(cap, dtype=np.int16)
        self.phase = np.full(cap, -1, dtype=np.int32)
        self.since = np.zeros(cap, dtype=np.float64)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, container: str) -> bool:
        return container in self._index

    def _grow(self, need: int) -> None:
        cap = len(self.filled)
        if need <= cap:
            return
        new = max(need, 2 * cap)
        self.frames = grown(self.frames, new - cap)
        self.filled = grown(self.filled, new - cap)
        self.phase = grown(self.phase, new - cap, -1)
        self.since = grown(self.since, new - cap)

    def rows(self, containers: Sequence[str]) -> np.ndarray:
        """Row of each container, allocating rows for new ones."""
        index = self._index
        out = np.fromiter((index.get(c, -1) for c in containers), dtype=np.intp, count=len(containers))
        if (out < 0).any():
            for i in np.flatnonzero(out < 0):
                c = containers[i]
                r = index.get(c)
                if r is None:
                    if self._free:
                        r = self._free.pop()
                    else:
                        r = len(index) + len(self._free)
                        self._grow(r + 1)
                    index[c] = r
                    self.filled[r] = 0
                    self.phase[r] = -1
                    self.since[r] = 0.0
                out[i] = r
        return out

    def forget(self, container: str) -> None:
        """Drop a container's state (its row is reused)."""
        r = self._index.pop(container, None)
        if r is not None:
            self._free.append(r)
            self.filled[r] = 0
            self.phase[r] = -1

    def state_bytes(self) -> float:
        """Measured bytes per container: array rows plus the id -> row dict entry."""
        n = max(len(self._index), 1)
        per_row = self.frames[0].nbytes + self.filled.itemsize + self.phase.itemsize + self.since.itemsize
        dict_bytes = sys.getsizeof(self._index) + sum(sys.getsizeof(k) + 28 for k in self._index)
        return per_row + dict_bytes / n


@dataclass
class DetectResult:
    """Per-row outcome of :func:`detect` (rows in the order of the input containers)."""

    phase: np.ndarray  #: phase in force from now on (-1: not known yet)
    prev_phase: np.ndarray  #: phase that was in force for this frame's step (credit its usage here)
    changed: np.ndarray  #: phase differs from the previous known phase
    since: np.ndarray  #: event time the current phase began
    ready: np.ndarray  #: window full
    windows: np.ndarray  #: raw windows of the rows, (n, window_len, n_features)
    changes: list[dict] = field(default_factory=list)  #: PhaseChange-shaped dicts


def detect(
    model: PhaseModel,
    state: Windows,
    containers: Sequence[str],
    frames: np.ndarray,
    ts: float | np.ndarray,
    host: str = "",
    stats_quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> DetectResult:
    """One vectorised detector step (pure apart from updating *state*).

    Parameters
    ----------
    model
        The snapshot (not modified).
    state
        The containers' windows (updated in place).
    containers
        Container ids, one frame each (no duplicates in one call).
    frames
        Raw usage ``(n, n_features)`` in the model's feature order (NaN = missing).
    ts
        Event time of the frames (scalar or per row).
    host
        Host for the ``PhaseChange`` dicts.
    """
    X = np.asarray(frames, dtype=np.float32)
    n = len(containers)
    if X.shape != (n, model.n_features):
        raise ValueError(f"frames must have shape ({n}, {model.n_features}), got {X.shape}")
    rows = state.rows(containers)
    if n > 1 and len(np.unique(rows)) != n:
        raise ValueError("a container appears twice in one detect() batch; send one frame per container")
    ts_arr = np.broadcast_to(np.asarray(ts, dtype=np.float64), (n,))
    W = state.frames[rows]
    W[:, :-1] = W[:, 1:]
    W[:, -1] = X
    fresh = state.filled[rows] == 0
    if fresh.any():
        W[fresh] = X[fresh][:, None, :]
    state.frames[rows] = W
    filled = np.minimum(state.filled[rows].astype(np.int32) + 1, 32767)
    state.filled[rows] = filled
    ready = filled >= state.window_len

    prev = state.phase[rows].astype(np.int64)
    phase = np.full(n, -1, dtype=np.int64)
    if ready.any() and model.ready:
        phase[ready] = model.predict(W[ready])
    known = phase >= 0
    changed = known & (phase != prev)
    since = state.since[rows]
    old_since = since.copy()
    since = np.where(changed, ts_arr, since)
    state.since[rows] = since
    state.phase[rows] = np.where(known, phase, prev)
    changes = []
    summaries: dict[int, dict] = {}  # one summary per distinct new phase in this batch
    for i in np.flatnonzero(changed):
        p = int(phase[i])
        if p not in summaries:
            summaries[p] = model.clusterer.phase_stats(p, stats_quantiles)
        changes.append(
            {
                "container": containers[i],
                "host": host,
                "ts": float(ts_arr[i]),
                "old_phase": int(prev[i]) if prev[i] >= 0 else None,
                "new_phase": p,
                "since": float(old_since[i]) if prev[i] >= 0 else float(ts_arr[i]),
                "stats": summaries[p],
            }
        )
    return DetectResult(
        phase=np.where(known, phase, prev),
        prev_phase=prev,
        changed=changed,
        since=since,
        ready=ready,
        windows=W,
        changes=changes,
    )


def learn(
    model: PhaseModel,
    windows: np.ndarray,
    *,
    stats_phases: np.ndarray | None = None,
    usage: np.ndarray | None = None,
    levels: np.ndarray | None = None,
    copy: bool = False,
) -> PhaseModel:
    """Learner step: train the snapshot on a sample of raw windows; returns it.

    The normaliser learns the windows' current frames, the CRBM makes one
    CD-k step on the batch, and (after warm-up) the clusterer learns their
    activations. ``stats_phases`` / ``usage`` credit measured usage to the
    phases in force (``DetectResult.prev_phase`` and the frames). ``levels``
    (same shape as ``usage``): each row's container level just before the
    step (:class:`~phasewise.models.phases.fleet.PhaseFleet` keeps one per
    container); ``usage / level`` is credited to the relative statistics
    (:attr:`PhaseClusterer.rel_stats`) where the level is positive. With
    ``copy=True`` the input snapshot is left untouched.
    """
    m = model.clone() if copy else model
    W = np.asarray(windows, dtype=np.float64)
    if W.ndim == 2:
        W = W[None]
    if len(W):
        m.normalizer.learn_many(W[:, -1, :])
        Z = m.normalizer.transform_many(W).reshape(len(W), -1).astype(np.float32)
        m.crbm.learn_many(Z)
        if m.crbm.n_seen >= m.warmup:
            m.clusterer.learn_many(m.crbm.predict_many(Z))
    if stats_phases is not None and usage is not None:
        sp = np.asarray(stats_phases).reshape(-1)
        keep = sp >= 0
        if keep.any():
            U = np.asarray(usage, dtype=np.float64).reshape(len(sp), -1)
            m.clusterer.update_stats(sp[keep], U[keep])
            if levels is not None:
                Lv = np.asarray(levels, dtype=np.float64).reshape(U.shape)
                m.clusterer.update_rel_stats(sp[keep], relative_usage(U, Lv)[keep])
    return m


def relative_usage(usage: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """``usage / level`` where the level is positive and finite, NaN elsewhere (not credited).

    >>> relative_usage(np.array([[2.0, 1.0, 0.0]]), np.array([[4.0, 0.0, 5.0]])).tolist()
    [[0.5, nan, 0.0]]
    """
    U = np.asarray(usage, dtype=np.float64)
    Lv = np.asarray(levels, dtype=np.float64)
    ok = np.isfinite(U) & np.isfinite(Lv) & (Lv > 0)
    return np.where(ok, U / np.where(ok, Lv, 1.0), np.nan)
