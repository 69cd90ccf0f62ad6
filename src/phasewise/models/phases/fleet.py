"""Phase limits for many containers sharing one phase model: the live detector (:class:`PhaseFleet`).

:meth:`PhaseFleet.step` runs one batched detection over a host message's
containers and returns their phases, their limits for the next step (the
phase's statistics, relative to each container's level by default, or the
caller's fallback) and the windows picked for learning; per-container state
is a few array rows. Pure. The limit rule: docs/phases.md, "Limits".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phasewise.models.arrays import grown
from phasewise.models.phases.clusterer import DEFAULT_QUANTILES
from phasewise.models.phases.detector import PhaseModel, Windows, detect, learn
from phasewise.models.phases.transitions import Transition, TransitionBook

__all__ = ["STATE_VERSION", "FleetStep", "PhaseFleet", "phase_limits", "pick_every_k"]

#: format of :meth:`PhaseFleet.state_of` dicts
#: 2: adds the container's level ("lv"); version-1 states still load (level rebuilt from the window)
STATE_VERSION = 2
STATISTICS = ("absolute", "relative")

_LOG_Q = math.log(1.05)  # the adaptive multiplier moves in steps of 5 %
_MAX_LSCALE = math.log(8.0)

FallbackLimits = (
    np.ndarray | Mapping[str, Mapping[str, float | None]] | Callable[[np.ndarray], np.ndarray] | None
)


def pick_every_k(ready: np.ndarray, counter: int, every_k: int) -> tuple[np.ndarray, int]:
    """Indices of every ``every_k``-th ready row, counting from *counter*; returns (indices, new counter).

    >>> pick_every_k(np.array([True, False, True, True, True]), 1, 2)
    (array([2, 4]), 5)
    """
    idx = np.flatnonzero(ready)
    k = max(1, int(every_k))
    pos = counter + np.arange(len(idx))
    return idx[pos % k == 0], counter + len(idx)


def phase_limits(
    q: np.ndarray,
    counts: np.ndarray,
    phase: np.ndarray,
    slot_ok: np.ndarray,
    prev_basis: np.ndarray,
    prev_limit_phase: np.ndarray,
    prev_from_phase: np.ndarray,
    fallback: np.ndarray,
    floors: np.ndarray,
    *,
    margin: float | np.ndarray,
    min_phase_samples: int,
    change_threshold: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PhasePolicy's limit rule over rows ``(n, n_resources)``; returns (limits, basis, from_phase, limit_phase).

    ``q``/``counts``: the current phase's quantile and sample count per
    resource (NaN / 0 when unknown); ``slot_ok``: the phase is open in the
    model; ``prev_*``: the rows' state from the last call; ``fallback``: the
    reactive limits (NaN = none). Limits are NaN where neither applies.

    >>> lim, basis, src, lp = phase_limits(
    ...     q=np.array([[1.0, 2.0]]), counts=np.array([[20, 5]]), phase=np.array([3]),
    ...     slot_ok=np.array([True]), prev_basis=np.full((1, 2), np.nan),
    ...     prev_limit_phase=np.array([-1]), prev_from_phase=np.zeros((1, 2), bool),
    ...     fallback=np.array([[4.0, 8.0]]), floors=np.array([0.0, 9.0]),
    ...     margin=0.1, min_phase_samples=10, change_threshold=0.05)
    >>> lim.round(3).tolist(), src.tolist(), lp.tolist()
    ([[1.1, 9.0]], [[True, False]], [3])
    """
    usable = slot_ok[:, None] & (counts >= min_phase_samples) & np.isfinite(q)
    keep = (
        (phase == prev_limit_phase)[:, None]
        & prev_from_phase
        & np.isfinite(prev_basis)
        & (np.abs(q - prev_basis) <= change_threshold * np.maximum(prev_basis, 1e-12))
    )
    basis = np.where(usable, np.where(keep, prev_basis, q), np.nan)
    limits = np.where(usable, basis * (1.0 + margin), fallback)
    limits = np.where(np.isfinite(limits), np.maximum(limits, floors), np.nan)
    limit_phase = np.where(slot_ok, phase, -1)
    return limits, basis, usable, limit_phase


@dataclass
class FleetStep:
    """Outcome of :meth:`PhaseFleet.step`, rows in the order of the input containers."""

    containers: Sequence[str]
    resources: tuple[str, ...]
    phase: np.ndarray  #: phase in force from now on (-1: not known yet)
    changed: np.ndarray  #: the phase changed at this step
    limits: np.ndarray  #: (n, R) limits for the next step, NaN = none
    from_phase: np.ndarray  #: (n, R) True where the limit came from the phase statistics
    decide: np.ndarray  #: (n, R) True where the limit differs from the one last handed out
    quantile: np.ndarray  #: (n, R) the phase quantile (NaN: unknown)
    counts: np.ndarray  #: (n, R) the phase's sample counts
    basis: np.ndarray  #: (n, R) the quantile the phase limit is based on (hysteresis)
    windows: np.ndarray  #: (n, window_len, n_features) raw windows
    prev_phase: np.ndarray  #: phase that was in force for this frame (credit its usage there)
    frames: np.ndarray  #: (n, n_features) the frames, as given
    sample: np.ndarray  #: row indices picked for learning (every k-th ready window)
    changes: list[dict] = field(default_factory=list)  #: PhaseChange-shaped dicts
    levels: np.ndarray | None = None  #: (n, R) each row's level just before this frame (learn: usage / level)
    statistics: str = "absolute"  #: which phase statistics set the limits (``quantile`` is in usage units)
    rows: np.ndarray | None = None  #: the fleet's rows of the containers (for :meth:`PhaseFleet.hand_out`)
    #: rows whose limits were raised ahead of a likely transition: the transition and the resources raised
    ahead: dict[int, tuple[Transition, tuple[str, ...]]] = field(default_factory=dict)

    def rows_to_decide(self) -> np.ndarray:
        """Rows with at least one limit to hand out."""
        return np.flatnonzero(self.decide.any(axis=1))

    def explain(self, i: int, quantile: float = 0.95) -> dict[str, Any]:
        """Phase id, per-resource source and statistics behind row *i*'s limits (non-finite: None)."""
        return self.explain_rows([i], quantile)[0]

    def explain_rows(self, rows: Sequence[int] | np.ndarray, quantile: float = 0.95) -> list[dict[str, Any]]:
        """:meth:`explain` of each of *rows* (the arrays are read once for all of them)."""
        tag = f"p{round(quantile * 100)}"
        idx = np.asarray(rows, dtype=np.int64)
        res = self.resources
        fp = self.from_phase[idx].tolist()
        q, cnt, basis = self.quantile[idx].tolist(), self.counts[idx].tolist(), self.basis[idx].tolist()
        # relative statistics: the quantile is level x the phase's quantile of usage/level
        lv = self.levels[idx].tolist() if self.statistics == "relative" and self.levels is not None else None
        out = []
        ahead = self.ahead
        for k, p in enumerate(self.phase[idx].tolist()):
            f = fp[k]
            stats = {}
            for j, r in enumerate(res):
                if f[j]:
                    st = {tag: _finite_or_none(q[k][j]), "count": int(cnt[k][j]),
                          "basis": _finite_or_none(basis[k][j])}
                    if lv is not None:
                        st["level_before"] = _finite_or_none(lv[k][j])
                    stats[r] = st
            out.append({
                "phase": p if p >= 0 else None,
                "source": "phase" if any(f) else "fallback",
                "sources": {r: ("phase" if f[j] else "fallback") for j, r in enumerate(res)},
                "stats": stats,
                "statistics": self.statistics,
            })
            got = ahead.get(int(idx[k])) if ahead else None
            if got is not None:
                out[-1]["anticipated"] = {**got[0].explain(), "raised": list(got[1])}
        return out


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _StatsMemo:
    """The model as :func:`detect` sees it, with phase statistics computed once per phase.

    ``detect`` summarises the new phase's statistics for every change it
    reports; with many containers switching at once that is the same few
    phases over and over. The memo is cleared whenever the model changes.
    """

    def __init__(self, model: PhaseModel, memo: dict) -> None:
        self._model = model
        self.clusterer = _ClustererMemo(model.clusterer, memo)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _ClustererMemo:
    def __init__(self, clusterer: Any, memo: dict) -> None:
        self._c = clusterer
        self._memo = memo

    def phase_stats(self, phase_id: int, qs: Sequence[float] = DEFAULT_QUANTILES) -> dict:
        key = (phase_id, tuple(qs))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._c.phase_stats(phase_id, qs)
        return {r: dict(v) for r, v in hit.items()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


class PhaseFleet:
    """Per-container phase limits for many containers sharing one :class:`PhaseModel`.

    Parameters
    ----------
    model
        The shared snapshot (used in place; pass a clone to keep yours).
    floors
        Per-resource safety floors; no limit is ever below them.
    quantile, margin
        Phase limit = phase ``quantile`` x (1 + ``margin``).
    min_phase_samples
        A phase's statistics of a resource are used once they hold this many samples.
    change_threshold
        Within a phase, a limit is re-based only when the quantile moved by more than this fraction.
    learn_every
        Every this many ready windows (fleet-wide) one is picked for learning.
    frozen
        Never train the model (detectors of a worker; deterministic comparisons).
    state_write_interval_s
        A container's state is due for persisting after this much event time (or on a phase change).
    loader
        Called with a container id the fleet has not seen; returns a state dict
        written by :meth:`state_of` (or ``None``), e.g. a worker's table lookup.
    capacity
        Initial number of rows.
    statistics
        ``"absolute"``: limit = phase usage quantile x (1 + margin);
        ``"relative"``: limit = container level x phase quantile of usage/level x (1 + margin).
    level_half_life
        Half-life, in samples, of the decaying max that is a container's level.
    ratio_cap
        Relative statistics: the phase's quantile of usage/level is used up to
        this (``None``: no cap), so a limit is at most level x ratio_cap x
        (1 + margin). Usage that jumps far above its own level (a start-up
        ramp from MB to GB) makes ratio quantiles huge, and uncapped they
        turn into limits many times the container's use. Capping the
        quantile equals taking the quantile of capped ratios, so it applies
        to any model and snapshot as they are.
    resource_quantiles, resource_margins
        Per-resource overrides of ``quantile`` / ``margin`` (e.g. ``{"mem": 0.97}``).
    limited
        The resources that get limits (default: every feature). The others
        are features only (e.g. GPU use on a host where only CPU and memory
        can be limited): they shape the phases, but get no limit, no decision
        and no fallback.
    target_fulfilment, adapt_rate
        ``None``: off. Else the share of steps each container's phase limits
        should cover; its multiplier moves by ``adapt_rate`` (log units) per step.
    transitions
        A :class:`~phasewise.models.phases.transitions.TransitionBook` (``None``: no anticipation): the
        phase changes of containers stepped with a signature are learned into it, and a limit is raised
        to the next phase's limit ahead of a transition it predicts (:meth:`step`'s ``signatures``).

    Examples
    --------
    >>> import numpy as np
    >>> m = PhaseModel(features=("cpu", "mem"), n_hid=6, n_his=2, warmup=32, seed=0)
    >>> fleet = PhaseFleet(m, floors={"cpu": 0.05}, learn_every=1, min_phase_samples=5)
    >>> ids = ["a", "b"]
    >>> for t in range(120):
    ...     busy = (t // 20) % 2 == 1
    ...     X = np.array([[1.0 if busy else 0.02, 9e8 if busy else 2e8], [0.5, 5e8]])
    ...     out = fleet.step(float(t), ids, X, fallback_limits=np.array([[4.0, 8e9], [4.0, 8e9]]))
    >>> out.resources, bool(out.from_phase.all()), bool((out.limits[:, 0] >= 0.05).all())
    (('cpu', 'mem'), True, True)
    >>> fleet.state_bytes() <= 4096
    True
    """

    def __init__(
        self,
        model: PhaseModel,
        floors: Mapping[str, float] | None = None,
        quantile: float = 0.95,
        margin: float = 0.10,
        min_phase_samples: int = 10,
        change_threshold: float = 0.05,
        learn_every: int = 10,
        frozen: bool = False,
        state_write_interval_s: float = 30.0,
        loader: Callable[[str], Any] | None = None,
        capacity: int = 64,
        statistics: str = "absolute",
        level_half_life: float = 30.0,
        ratio_cap: float | None = None,
        target_fulfilment: float | None = None,
        adapt_rate: float = 0.05,
        resource_quantiles: Mapping[str, float] | None = None,
        resource_margins: Mapping[str, float] | None = None,
        limited: Sequence[str] | None = None,
        transitions: TransitionBook | None = None,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if learn_every < 1:
            raise ValueError(f"learn_every must be >= 1, got {learn_every}")
        if statistics not in STATISTICS:
            raise ValueError(f"statistics must be one of {STATISTICS}, got {statistics!r}")
        if not level_half_life > 0:
            raise ValueError(f"level_half_life must be > 0 samples, got {level_half_life}")
        if target_fulfilment is not None and not 0.0 < target_fulfilment < 1.0:
            raise ValueError(f"target_fulfilment must be in (0, 1) or None, got {target_fulfilment}")
        if adapt_rate <= 0:
            raise ValueError(f"adapt_rate must be > 0, got {adapt_rate}")
        self.resource_quantiles = dict(resource_quantiles or {})
        self.resource_margins = dict(resource_margins or {})
        for r, v in self.resource_quantiles.items():
            if not 0.0 < v <= 1.0:
                raise ValueError(f"resource_quantiles[{r!r}] must be in (0, 1], got {v}")
        for r, v in self.resource_margins.items():
            if v < 0:
                raise ValueError(f"resource_margins[{r!r}] must be >= 0, got {v}")
        unknown = sorted((set(self.resource_quantiles) | set(self.resource_margins)) - set(model.features))
        if unknown:
            raise ValueError(f"per-resource settings for {unknown}, not features of the model {model.features}")
        if limited is not None:
            stray = sorted(set(limited) - set(model.features))
            if stray or not limited:
                raise ValueError(f"limited must be a non-empty subset of the model's features {model.features}, "
                                 f"got {list(limited)}")
        self.limited = tuple(r for r in model.features if limited is None or r in limited)
        self._unlimited = np.array([r not in self.limited for r in model.features])
        self.target_fulfilment = None if target_fulfilment is None else float(target_fulfilment)
        self.adapt_rate = float(adapt_rate)
        self.statistics = statistics
        self.level_half_life = float(level_half_life)
        if ratio_cap is not None and not ratio_cap > 0:
            raise ValueError(f"ratio_cap must be > 0 or None, got {ratio_cap}")
        self.ratio_cap = math.inf if ratio_cap is None else float(ratio_cap)
        self._level_decay = 0.5 ** (1.0 / self.level_half_life)
        self.model = model
        self.transitions = transitions
        self.floors = dict(floors or {})
        self.quantile = float(quantile)
        self.margin = float(margin)
        self.min_phase_samples = int(min_phase_samples)
        self.change_threshold = float(change_threshold)
        self.learn_every = int(learn_every)
        self.frozen = bool(frozen)
        self.state_write_interval_s = float(state_write_interval_s)
        self.loader = loader
        self.capacity = int(capacity)
        self._windows = Windows(model.window_len, model.n_features, capacity=capacity)
        R = model.n_features
        cap = len(self._windows.filled)
        self._basis = np.full((cap, R), np.nan)
        self._from_phase = np.zeros((cap, R), dtype=bool)
        self._limit_phase = np.full(cap, -1, dtype=np.int32)
        self._handed = np.full((cap, R), np.nan)  # limits last handed out
        self._written = np.full(cap, -np.inf)  # event time of the last persisted state
        self._level = np.full((cap, R), np.nan)  # decaying max of the container's usage
        self._lscale = np.zeros((cap, R))  # log of the fulfilment-targeting multiplier
        self._seen = np.full(cap, -np.inf)  # event time of the newest step (for expire)
        self._floors = np.array([float(self.floors.get(r, 0.0)) for r in model.features])
        self._q_cache: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}
        self._stats_memo: dict = {}
        self._n_ready = 0  # ready windows seen (the sampling counter)
        self._n_learned = 0  # windows the model learned through this fleet
        self._dirty: set[str] = set()
        self.loaded = 0  # containers restored through the loader
        self.load_errors = 0

    # ------------------------------------------------------------------ model
    @property
    def resources(self) -> tuple[str, ...]:
        return self.model.features

    @property
    def windows_learned(self) -> int:
        return self._n_learned

    def set_model(self, model: PhaseModel) -> None:
        """Swap in a newer snapshot (same features and window length); containers keep their windows."""
        if model.features != self.model.features or model.window_len != self.model.window_len:
            raise ValueError(
                f"snapshot has features {model.features} / window {model.window_len}, this fleet "
                f"{self.model.features} / {self.model.window_len}"
            )
        self.model = model
        self._q_cache.clear()
        self._stats_memo.clear()

    def _phase_q(self, p: int) -> tuple[np.ndarray, np.ndarray, bool]:
        hit = self._q_cache.get(p)
        if hit is None:
            cl = self.model.clusterer
            slot = int(cl.slots_of(np.array([p]))[0])
            R = self.model.n_features
            if slot < 0:
                hit = (np.full(R, np.nan), np.zeros(R), False)
            else:
                st = cl.rel_stats if self.statistics == "relative" else cl.stats
                qs = self._quantiles()
                uq = sorted(set(qs.tolist()))
                Q = st.quantiles(slot, uq)
                hit = (Q[[uq.index(x) for x in qs.tolist()], np.arange(R)].astype(np.float64),
                       st.count(slot).astype(np.float64), True)
            self._q_cache[p] = hit
        return hit

    def _quantiles(self) -> np.ndarray:
        return np.array([float(self.resource_quantiles.get(r, self.quantile)) for r in self.model.features])

    def _margins(self) -> np.ndarray:
        return np.array([float(self.resource_margins.get(r, self.margin)) for r in self.model.features])

    # ------------------------------------------------------------------ rows
    def _sync(self) -> None:
        cap = len(self._windows.filled)
        old = len(self._limit_phase)
        if cap <= old:
            return
        k = cap - old
        self._basis = grown(self._basis, k, np.nan)
        self._from_phase = grown(self._from_phase, k)
        self._limit_phase = grown(self._limit_phase, k, -1)
        self._handed = grown(self._handed, k, np.nan)
        self._written = grown(self._written, k, -np.inf)
        self._level = grown(self._level, k, np.nan)
        self._lscale = grown(self._lscale, k)
        self._seen = grown(self._seen, k, -np.inf)

    def _reset_rows(self, rows: np.ndarray) -> None:
        self._basis[rows] = np.nan
        self._from_phase[rows] = False
        self._limit_phase[rows] = -1
        self._handed[rows] = np.nan
        self._written[rows] = -np.inf
        self._level[rows] = np.nan
        self._lscale[rows] = 0.0
        self._seen[rows] = -np.inf

    def __len__(self) -> int:
        return len(self._windows)

    def __contains__(self, container: str) -> bool:
        return container in self._windows

    def forget(self, container: str) -> None:
        """Drop a container's state (e.g. it stopped)."""
        self._windows.forget(container)
        self._dirty.discard(container)

    def expire(self, before_ts: float) -> list[str]:
        """Forget every container whose newest step is older than *before_ts* (event time).

        Returns them, so the caller deletes them from its table too; their rows are reused.
        """
        index = self._windows._index
        if not index:
            return []
        names = list(index)
        rows = np.fromiter(index.values(), dtype=np.intp, count=len(names))
        gone = [names[i] for i in np.flatnonzero(self._seen[rows] < before_ts).tolist()]
        for c in gone:
            self.forget(c)
        return gone

    def clear(self) -> None:
        """Forget every container (after a rebalance the worker's table is the truth)."""
        self._windows = Windows(self.model.window_len, self.model.n_features, capacity=self.capacity)
        cap = len(self._windows.filled)
        self._limit_phase = self._limit_phase[:0]
        self._basis = self._basis[:0]
        self._from_phase = self._from_phase[:0]
        self._handed = self._handed[:0]
        self._written = self._written[:0]
        self._level = self._level[:0]
        self._lscale = self._lscale[:0]
        self._seen = self._seen[:0]
        self._sync()
        assert len(self._limit_phase) == cap
        self._dirty.clear()

    def state_bytes(self) -> float:
        """Measured bytes per tracked container: window rows, id index, limit state."""
        R = self.model.n_features
        own = (R * (self._basis.itemsize + 1 + self._handed.itemsize + self._level.itemsize + self._lscale.itemsize)
               + self._limit_phase.itemsize + 8)
        return self._windows.state_bytes() + own

    def state_of(self, container: str) -> dict[str, Any]:
        """A container's state as a small JSON-able dict (for a changelogged table)."""
        r = self._windows._index[container]
        w = self._windows

        def fl(a: np.ndarray) -> list:
            return [None if not math.isfinite(x) else float(x) for x in a.tolist()]

        return {
            "v": STATE_VERSION, "f": [fl(row) for row in w.frames[r]], "n": int(w.filled[r]),
            "p": int(w.phase[r]), "s": fl(w.since[r:r + 1])[0], "b": fl(self._basis[r]),
            "src": [bool(x) for x in self._from_phase[r]], "lp": int(self._limit_phase[r]),
            "h": fl(self._handed[r]), "lv": fl(self._level[r]), "sc": fl(self._lscale[r]),
        }

    def load_state(self, container: str, state: Mapping[str, Any]) -> None:
        """Restore a container from :meth:`state_of` output; a foreign state raises ValueError."""
        R, L = self.model.n_features, self.model.window_len
        try:
            if state.get("v") not in (1, STATE_VERSION):
                raise ValueError(f"unsupported phase state version {state.get('v')!r} (this build reads 1 and "
                                 f"{STATE_VERSION})")
            frames = np.array([[np.nan if x is None else x for x in row] for row in state["f"]], dtype=np.float32)
            if frames.shape != (L, R) or len(state["b"]) != R or len(state["h"]) != R or len(state["src"]) != R:
                raise ValueError(f"phase state shaped for another model (frames {frames.shape}, expected {(L, R)})")
            basis = np.array([np.nan if x is None else x for x in state["b"]], dtype=np.float64)
            handed = np.array([np.nan if x is None else x for x in state["h"]], dtype=np.float64)
            filled, phase, lp = int(state["n"]), int(state["p"]), int(state["lp"])
            since = np.nan if state["s"] is None else float(state["s"])
            src = np.array([bool(x) for x in state["src"]])
            if state["v"] >= 2:
                level = np.array([np.nan if x is None else x for x in state["lv"]], dtype=np.float64)
                if level.shape != (R,):
                    raise ValueError(f"phase state level has {level.shape} values, expected {R}")
                lscale = np.array([0.0 if x is None else x for x in state.get("sc") or [0.0] * R], dtype=np.float64)
                if lscale.shape != (R,):
                    raise ValueError(f"phase state multiplier has {lscale.shape} values, expected {R}")
            else:  # version 1 had no level: the window's max is the best guess
                with np.errstate(all="ignore"):
                    level = np.where(np.isfinite(frames).any(0), np.nanmax(np.where(np.isfinite(frames), frames,
                                                                                     -np.inf), axis=0), np.nan)
                lscale = np.zeros(R)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed phase state: {type(e).__name__}: {e}") from None
        r = int(self._windows.rows([container])[0])
        self._sync()
        w = self._windows
        w.frames[r], w.filled[r], w.phase[r], w.since[r] = frames, min(filled, 32767), phase, since
        self._basis[r], self._handed[r], self._from_phase[r], self._limit_phase[r] = basis, handed, src, lp
        self._written[r] = -np.inf
        self._level[r] = level
        self._lscale[r] = lscale

    def marked(self) -> set[str]:
        """The containers marked for persisting (a copy; :meth:`pop_dirty` hands them out)."""
        return set(self._dirty)

    def mark(self, containers: Iterable[str]) -> None:
        """Mark these containers (those held) for persisting at the next :meth:`pop_dirty`."""
        self._dirty.update(c for c in containers if c in self._windows)

    def pop_dirty(self) -> list[tuple[str, dict[str, Any]]]:
        """Containers whose state is due for persisting, with their state (each handed out once)."""
        out = [(c, self.state_of(c)) for c in self._dirty if c in self._windows]
        self._dirty.clear()
        return out

    # ------------------------------------------------------------------ hot path
    def _fallback(self, fb: FallbackLimits, containers: Sequence[str], need: np.ndarray) -> np.ndarray:
        n, R = len(containers), self.model.n_features
        out = np.full((n, R), np.nan)
        if fb is None or not need.any():
            return out
        if callable(fb):
            idx = np.flatnonzero(need)
            vals = np.asarray(fb(idx), dtype=np.float64)
            if vals.shape != (len(idx), R):
                raise ValueError(f"fallback callable returned shape {vals.shape}, expected {(len(idx), R)}")
            out[idx] = vals
            return out
        if isinstance(fb, Mapping):
            feats = self.model.features
            for i in np.flatnonzero(need):
                d = fb.get(containers[i]) or {}
                for j, r in enumerate(feats):
                    v = d.get(r)
                    if v is not None:
                        out[i, j] = float(v)
            return out
        arr = np.asarray(fb, dtype=np.float64)
        if arr.shape != (n, R):
            raise ValueError(f"fallback_limits must have shape {(n, R)}, got {arr.shape}")
        return arr

    def step(
        self,
        t: float | np.ndarray,
        containers: Sequence[str],
        frames: np.ndarray,
        fallback_limits: FallbackLimits = None,
        host: str = "",
        signatures: Sequence[str | None] | None = None,
    ) -> FleetStep:
        """One batched detector step at event time *t* for *containers* (one frame each).

        *t*: one event time, or one per row (distinct containers of several
        messages in one step).

        ``frames``: raw usage ``(n, n_features)`` in :attr:`resources` order
        (NaN = missing). ``fallback_limits``: the reactive limits, as an
        ``(n, R)`` array (NaN = none), a mapping container -> {resource: limit},
        or a callable taking the row indices that need a fallback and
        returning their ``(k, R)`` limits (only called when some row does).
        ``signatures``: each row's workload signature (``None``: none); with the fleet's
        ``transitions`` book, signed rows' phase changes are learned and their limits raised ahead of
        a likely transition (:meth:`_anticipate`).
        """
        X = np.asarray(frames, dtype=np.float64)
        n = len(containers)
        m = self.model
        if X.shape != (n, m.n_features):
            raise ValueError(f"frames must have shape ({n}, {m.n_features}), got {X.shape}")
        X = np.where(np.isfinite(X), np.maximum(X, 0.0), np.nan)
        w = self._windows
        rows = w.rows(containers)
        self._sync()
        new = w.filled[rows] == 0
        if new.any():
            new_rows = rows[new]
            self._reset_rows(new_rows)
            if self.loader is not None:
                for i in np.flatnonzero(new):
                    c = containers[i]
                    try:
                        state = self.loader(c)
                        if state is not None:
                            self.load_state(c, state)
                            self.loaded += 1
                    except ValueError:  # a foreign or corrupt stored state: start this container fresh
                        self.load_errors += 1
        self._seen[rows] = np.fmax(self._seen[rows], t)
        res = detect(_StatsMemo(m, self._stats_memo), w, containers, X, t, host=host)  # type: ignore[arg-type]
        phase = res.phase
        R = m.n_features
        # the level: a decaying max of the container's own usage (missing frames keep the decayed level)
        level_prev = self._level[rows]
        level = np.fmax(X, level_prev * self._level_decay)
        self._level[rows] = level
        if self.target_fulfilment is not None:  # adapt to this frame's miss of the phase limit in force
            in_force = self._handed[rows]
            seen = self._from_phase[rows] & np.isfinite(X) & np.isfinite(in_force)
            miss = X > in_force * (1.0 + 1e-9)
            step_ = self.adapt_rate * (miss.astype(np.float64) - (1.0 - self.target_fulfilment))
            self._lscale[rows] = np.clip(self._lscale[rows] + np.where(seen, step_, 0.0), -_MAX_LSCALE, _MAX_LSCALE)
        q = np.full((n, R), np.nan)
        cnt = np.zeros((n, R))
        slot_ok = np.zeros(n, dtype=bool)
        if m.ready:
            known = phase >= 0
            if known.any():
                uniq, inv = np.unique(phase[known], return_inverse=True)
                table = [self._phase_q(int(p)) for p in uniq]
                Q = np.stack([x[0] for x in table])
                C = np.stack([x[1] for x in table])
                ok = np.array([x[2] for x in table])
                q[known], cnt[known], slot_ok[known] = Q[inv], C[inv], ok[inv]
                if self.statistics == "relative":
                    # capped ratio quantile -> this container's usage units (NaN without a level)
                    q = np.minimum(q, self.ratio_cap) * level
        # rows that may need the fallback: a resource without usable phase statistics
        usable_guess = slot_ok[:, None] & (cnt >= self.min_phase_samples) & np.isfinite(q)
        fb = self._fallback(fallback_limits, containers, ~usable_guess.all(axis=1))
        limits, basis, from_phase, limit_phase = phase_limits(
            q, cnt, phase, slot_ok, self._basis[rows], self._limit_phase[rows], self._from_phase[rows], fb,
            self._floors, margin=self._margins(), min_phase_samples=self.min_phase_samples,
            change_threshold=self.change_threshold,
        )
        mult = None
        if self.target_fulfilment is not None:
            mult = np.exp(_LOG_Q * np.round(self._lscale[rows] / _LOG_Q))
            limits = np.where(from_phase, np.maximum(basis * (1.0 + self._margins()) * mult, self._floors), limits)
        ahead: dict[int, tuple[Transition, tuple[str, ...]]] = {}
        if self.transitions is not None and signatures is not None:
            ahead = self._anticipate(t, signatures, res, limits, level, mult)
        if self._unlimited.any():  # features only: no limit, so nothing to hand out or to explain
            limits = np.where(self._unlimited, np.nan, limits)
            from_phase = from_phase & ~self._unlimited
        handed = self._handed[rows]
        decide = np.isfinite(limits) & (
            ~np.isfinite(handed) | (np.abs(limits - handed) > 1e-9 * np.maximum(np.abs(handed), 1e-12))
        )
        self._basis[rows] = basis
        self._from_phase[rows] = from_phase
        self._limit_phase[rows] = limit_phase
        self._handed[rows] = np.where(decide, limits, handed)
        # persistence: on a phase change or after state_write_interval_s of event time
        due = res.changed | new | (t - self._written[rows] >= self.state_write_interval_s)
        if due.any():
            self._written[rows[due]] = t[due] if isinstance(t, np.ndarray) else t
            self._dirty.update(containers[i] for i in np.flatnonzero(due))
        # learning sample
        sel, self._n_ready = pick_every_k(res.ready, self._n_ready, self.learn_every)
        if len(sel) and not self.frozen:
            self.learn_windows(res.windows[sel], res.prev_phase[sel], X[sel], level_prev[sel])
        return FleetStep(
            containers=containers, resources=m.features, phase=phase, changed=res.changed, limits=limits,
            from_phase=from_phase, decide=decide, quantile=q, counts=cnt, basis=basis, windows=res.windows,
            prev_phase=res.prev_phase, frames=X, sample=sel, changes=res.changes, levels=level_prev,
            statistics=self.statistics, rows=rows, ahead=ahead,
        )

    def _anticipate(self, t: float | np.ndarray, signatures: Sequence[str | None], res: Any, limits: np.ndarray,
                    level: np.ndarray, mult: np.ndarray | None) -> dict[int, tuple[Transition, tuple[str, ...]]]:
        """Learn the signed rows' phase changes of this step; raise *limits* (in place) of signed rows to
        the limit of the phase the book predicts next, where that is higher than the limit in force.

        The next phase's limit follows the step's own rule (its statistics, the row's level with relative
        statistics, the margins, the fulfilment multiplier, the floors); a resource without a finite limit
        now, or whose next phase has too few samples, is left as it is. The raise holds while the book
        predicts the transition; afterwards the row's own phase limit applies again (lowered after)."""
        book = self.transitions
        assert book is not None
        if res.changes:
            for i, ch in zip(np.flatnonzero(res.changed).tolist(), res.changes):
                s, old = signatures[i], ch["old_phase"]
                if s is not None and old is not None:
                    book.learn(s, old, ch["new_phase"], ch["ts"] - ch["since"])
        out: dict[int, tuple[Transition, tuple[str, ...]]] = {}
        if not book.config.on or not self.model.ready:
            return out
        tt = np.broadcast_to(np.asarray(t, dtype=np.float64), (len(signatures),))
        phase, since = res.phase, res.since
        margins = 1.0 + self._margins()
        relative = self.statistics == "relative"
        feats = self.model.features
        for i, s in enumerate(signatures):
            if s is None or phase[i] < 0 or not book.knows(s):
                continue
            tr = book.predict(s, int(phase[i]), float(tt[i] - since[i]))
            if tr is None:
                continue
            Q, C, ok = self._phase_q(tr.next_phase)
            if not ok:
                continue
            if relative:
                Q = np.minimum(Q, self.ratio_cap) * level[i]
            lim = Q * margins if mult is None else Q * margins * mult[i]
            lim = np.maximum(lim, self._floors)
            cur = limits[i]
            use = (C >= self.min_phase_samples) & np.isfinite(lim) & np.isfinite(cur) & (lim > cur) & ~self._unlimited
            if use.any():
                limits[i] = np.where(use, lim, cur)
                out[i] = (tr, tuple(r for r, u in zip(feats, use.tolist()) if u))
        return out

    def hand_out(self, step: FleetStep, limits: np.ndarray, mask: np.ndarray) -> None:
        """Record, where *mask* ``(n, R)``, what was really handed out for *step*'s rows instead of the
        step's limits: *limits* (NaN: nothing, so the next step proposes its limit again).

        The worker's safety rules may bound or hold back a proposed limit; the fleet then compares
        its next limits with what is in force, not with what it proposed."""
        rows = step.rows
        if rows is None:
            raise ValueError("hand_out needs the FleetStep of this fleet's last step")
        if mask.any():
            self._handed[rows] = np.where(mask, limits, self._handed[rows])

    # ------------------------------------------------------------------ learning
    def learn_windows(self, windows: np.ndarray, stats_phases: np.ndarray | None = None,
                      usage: np.ndarray | None = None, levels: np.ndarray | None = None) -> int:
        """Train the shared model on these windows (no-op when frozen); returns how many it learned.

        ``levels``: the containers' levels just before the credited usage
        (:attr:`FleetStep.levels`); without them only the absolute statistics learn.
        """
        if self.frozen or not len(windows):
            return 0
        learn(self.model, windows, stats_phases=stats_phases, usage=usage, levels=levels)
        self._q_cache.clear()
        self._stats_memo.clear()
        self._n_learned += len(windows)
        return len(windows)

    def learn_sample(self, windows: np.ndarray, every_k: int | None = None,
                     stats_phases: np.ndarray | None = None, usage: np.ndarray | None = None,
                     levels: np.ndarray | None = None) -> np.ndarray:
        """Pick every ``every_k``-th of these (ready) windows, continuing the fleet's count, and learn them.

        Returns the picked indices (picked even when frozen, then not learned).
        """
        W = np.asarray(windows)
        sel, self._n_ready = pick_every_k(np.ones(len(W), bool), self._n_ready, every_k or self.learn_every)
        if len(sel):
            self.learn_windows(
                W[sel],
                None if stats_phases is None else np.asarray(stats_phases)[sel],
                None if usage is None else np.asarray(usage)[sel],
                None if levels is None else np.asarray(levels)[sel],
            )
        return sel
